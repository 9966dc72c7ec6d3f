// push_assembly.h: the state machine that turns a push's incoming messages into one optimizer
// step, free of gRPC.
//
// A push may travel as several parallel calls ("parts", PushHeader.part_index/part_count) that
// share one PushAssembly, found by (client_id, sequence_number) in PushAssemblies; a single call
// is an assembly of one part. The assembly:
//   1. reserves the push's staging (the size of its tensors in the wire dtype) in the
//      StagingPool, before any chunk is read (back-pressure);
//   2. checks each message's chunks (ChunkAssembler: tensor, range, overlap), copies each
//      payload once from the transport's buffer into staging, checks it for non-finite values
//      and starts its copy to the device, outside its lock, so that parts ingest concurrently;
//   3. once every part has ended well and every element has arrived (and, for a push whose
//      header has commit_at_end, its commit with the step's grad_scale), hands the push to the
//      UpdateEngine as one step, and gives every part the same reply when the step is back.
// A part that fails fails the push: that part gets its error, the others ABORTED. Nothing before
// step 3 touches the shard, so a failed push leaves it bit-identical.
//
// The transport (server/service/push_reactor.h) implements PushPart for each call.
//
// Lifetimes: an assembly lives as long as a shared_ptr to it: held by its parts (their calls),
// by PushAssemblies while it assembles, by the staging pool's callback while it waits, and by
// the engine's callback while its step runs. Its staging reservation goes back when it dies,
// after the step's device work is done. A part must stay alive until the assembly has called
// its Finish; the assembly never touches a part after that.
//
// Thread safety: every method may be called from any thread.
#ifndef FUSEDPS_SERVER_INGEST_PUSH_ASSEMBLY_H_
#define FUSEDPS_SERVER_INGEST_PUSH_ASSEMBLY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/engine/update_engine.h"
#include "server/ingest/chunk_assembler.h"
#include "server/ingest/pull_request.h"
#include "server/ingest/push_message.h"
#include "server/ingest/staging_pool.h"
#include "server/ingest/table_rows.h"
#include "server/metrics/metrics.h"
#include "server/store/retry_table.h"
#include "server/store/shard_view.h"
#include "server/workspace/workspace.h"

namespace fusedps {

inline constexpr uint32_t kMaxPushParts = 64;
inline constexpr char kSkipNonFiniteGrad[] = "non_finite_grad";

// One part's end of the conversation with its assembly (a gRPC call, or a test's fake).
class PushPart {
 public:
  virtual ~PushPart() = default;
  // A message is about to be added (AddMessage): the part must stay alive until it has been
  // (the reactor counts a message in flight). For the first message the assembly calls it under
  // its lock, right before OnStagingReady; the part calls it itself for each later one.
  virtual void BeginMessage() = 0;
  // The push's staging is reserved: the part adds its first message now (AddMessage with
  // first = true), then reads on. At most once per part, never under the assembly's lock.
  virtual void OnStagingReady() = 0;
  // The end of the part: the push's outcome. Exactly once per part that joined, never under
  // the assembly's lock; `stages` is set when status is OK and the push was applied or skipped.
  virtual void Finish(const absl::Status& status, const PushReply& reply,
                      const PushStageSeconds& stages) = 0;
};

class PushAssemblies;

// What assemblies use. All outlive every assembly.
struct IngestServices {
  UpdateEngine* engine;
  StagingPool* staging;
  Metrics* metrics;
  PushAssemblies* assemblies;
  // Keeps the engine and the assemblies alive while a push holds these (the server's model,
  // server/models/model.h); may be null when they outlive every push anyway.
  std::shared_ptr<void> owner = nullptr;
  std::string model = "default";  // Its name, for the metrics' `model` label.
};

// A push header, checked against a view: its tensors' indices and its dtype.
struct CheckedPushHeader {
  std::vector<uint32_t> tensors;
  std::vector<uint32_t> tables;  // header.tables: embedding tables of the view.
  GradDType dtype = GradDType::kFloat32;
  uint32_t part_count = 1;
  // The header's workspace (PushHeader.workspace), found by the transport; null for none. The
  // assembly holds it until it dies, so its memory outlives every read of the push.
  std::shared_ptr<const Workspace> workspace;
};

// Checks a push header: dtype, grad_scale, worker_count, client_id's length, the parts fields,
// each tensor named once, registered and not an embedding table (when it names none: all of
// the shard's but its tables, or none when it names tables), each table named once and a
// table. Errors: INVALID_ARGUMENT naming the field and the limit; NOT_FOUND for an unknown
// tensor; UNIMPLEMENTED for worker_count > 1.
absl::StatusOr<CheckedPushHeader> CheckPushHeader(const v1::PushHeader& header,
                                                  const ShardView& view);

// INVALID_ARGUMENT naming `field` for anything but FLOAT32, BFLOAT16 or FLOAT16.
absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field);

class PushAssembly : public std::enable_shared_from_this<PushAssembly> {
 public:
  // `key` is empty for a push of one part (not in PushAssemblies).
  PushAssembly(const IngestServices& services, std::string key, v1::PushHeader header,
               std::shared_ptr<const ShardView> view, CheckedPushHeader checked);

  // Adds a part. Errors: INVALID_ARGUMENT for a header unlike the first part's (the push then
  // fails); ABORTED for a part index that joined already, or once the push failed or ended.
  // Calls part->OnStagingReady() at once when the staging is ready.
  absl::Status Join(PushPart* part, uint32_t index, const v1::PushHeader& header)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Reserves the staging; the part that created the assembly calls it once, after joining.
  void Reserve() ABSL_LOCKS_EXCLUDED(mu_);

  // Checks one message's chunks and copies them into staging (see the file comment). Only the
  // checks hold the assembly's lock. `first`: the message that carried the header;
  // `part_index`: the part it came on. A message's commit (PushHeader.commit_at_end) is taken
  // here. Errors (besides the chunks'): INVALID_ARGUMENT for a commit in a push without
  // commit_at_end, a second commit, a commit.grad_scale that is not finite and > 0, and a
  // message after its part's commit.
  absl::Status AddMessage(MessageSlices message, bool first, uint32_t part_index,
                          uint64_t* bytes_added) ABSL_LOCKS_EXCLUDED(mu_);

  // A part's stream ended well. The last one submits the push; with commit_at_end, the push
  // fails (INVALID_ARGUMENT) when no part sent the commit.
  void PartEnded() ABSL_LOCKS_EXCLUDED(mu_);

  // The push fails: `part` (if any) gets `status`, the other parts ABORTED.
  void Fail(const PushPart* part, const absl::Status& status) { Fail(part, status, false); }
  // The push fails as a whole (not because of one part): every part gets `status`.
  void FailAll(const absl::Status& status) { Fail(nullptr, status, true); }

  absl::Time arrived() const { return arrived_; }  // When its first part's header arrived.
  uint32_t parts_joined() const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t part_count() const { return checked_.part_count; }

 private:
  void OnReserved(absl::StatusOr<StagingPool::Reservation> reservation) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status TakeCommit(v1::PushCommit commit, uint32_t part_index) ABSL_LOCKS_EXCLUDED(mu_);
  // A message's table rows (TableRowsAssembler::Add's errors).
  absl::Status TakeTableRows(const std::vector<v1::TableRows>& rows) ABSL_LOCKS_EXCLUDED(mu_);
  // The step is back: runs the commit's pull, if any, then Answer.
  void OnApplied(const absl::StatusOr<StepResult>& result) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives every part the push's outcome; `stepped`: when the step was back.
  void Answer(const absl::StatusOr<StepResult>& result, absl::Time stepped)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Fail(const PushPart* part, const absl::Status& status, bool whole_push)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<PushPart*> TakePartsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool SameHeader(const v1::PushHeader& header) const;
  // The push names a device workspace: its chunks are copied and checked on the device, and
  // the host holds no copy of them (AddMessage, PartEnded).
  bool ThroughDeviceWorkspace() const {
    return checked_.workspace != nullptr && checked_.workspace->on_device();
  }

  const IngestServices services_;
  const std::string key_;
  const v1::PushHeader header_;
  const std::shared_ptr<const ShardView> view_;  // The view its tensors were resolved in.
  const CheckedPushHeader checked_;
  const absl::Time arrived_ = absl::Now();

  mutable Mutex mu_;
  // By part index; null: not joined, or finished.
  std::vector<PushPart*> parts_ ABSL_GUARDED_BY(mu_);
  uint32_t joined_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t ended_ ABSL_GUARDED_BY(mu_) = 0;
  // Moved into the assembler when the staging is granted.
  std::vector<ChunkAssembler::Expected> expected_ ABSL_GUARDED_BY(mu_);
  // The staging is reserved and the assembler exists.
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool over_ ABSL_GUARDED_BY(mu_) = false;                     // Failed, or submitted.
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;                   // The staging pool's, while waiting.
  StagingPool::Reservation reservation_ ABSL_GUARDED_BY(mu_);  // Set once, before ready_.
  std::optional<ChunkAssembler> assembler_ ABSL_GUARDED_BY(mu_);
  bool grads_finite_ ABSL_GUARDED_BY(mu_) = true;
  // Through a device workspace: what every message saw of the gradients (AddMessage).
  GradCheck device_seen_ ABSL_GUARDED_BY(mu_);
  // commit_at_end: the commit, once it came.
  std::optional<v1::PushCommit> commit_ ABSL_GUARDED_BY(mu_);
  int64_t commit_part_ ABSL_GUARDED_BY(mu_) = -1;  // The part that sent it.
  // The commit's pull (PushCommit.pull), planned as it came; run once the step is back.
  std::optional<PullPlan> commit_pull_ ABSL_GUARDED_BY(mu_);
  // The embedding tables' rows, when the header names tables.
  std::optional<TableRowsAssembler> table_rows_ ABSL_GUARDED_BY(mu_);
  // Guarded by mu_ up to here.
  std::atomic<int64_t> ingest_nanos_{0};  // PushStageSeconds::ingest, summed over messages.
  absl::Time received_;                   // Written once, before the push is submitted.
  ReadyPush push_;                        // Likewise; the engine reads it until its callback runs.
};

// The multi-part pushes being assembled, by (client_id, sequence_number). A push that failed
// stays known for a minute, so that its late parts are ABORTED rather than start it anew. A push
// whose parts have not all arrived within `part_wait` of its first fails with
// DEADLINE_EXCEEDED (every part that came gets it, and its staging goes back): a trainer that
// dies between parts cannot hold staging for ever. A thread checks four times per part_wait, at
// least once a second.
class PushAssemblies {
 public:
  explicit PushAssemblies(absl::Duration part_wait);
  ~PushAssemblies();  // Stops the checks; pushes still assembling are left to their parts.
  PushAssemblies(const PushAssemblies&) = delete;
  PushAssemblies& operator=(const PushAssemblies&) = delete;

  static std::string Key(const v1::PushHeader& header);

  // The assembly under `key`, made by `make` if there is none; `created` says which. Null
  // when the push under `key` failed within the last minute.
  std::shared_ptr<PushAssembly> FindOrCreate(
      const std::string& key, const std::function<std::shared_ptr<PushAssembly>()>& make,
      bool* created) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `assembly` (if it is still the one under `key`); with `failed`, remembers that the
  // push under `key` failed.
  void Remove(const std::string& key, const PushAssembly* assembly, bool failed)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void FailLatePushes() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration part_wait_;
  Mutex mu_;
  CondVar stop_cv_;
  absl::flat_hash_map<std::string, std::shared_ptr<PushAssembly>> assemblies_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread checker_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_PUSH_ASSEMBLY_H_
