// update_engine.h: the single writer of a shard's state.
//
// The engine owns the optimizer backend and everything that changes: tensors, param groups,
// steps, the version. Every change is a job in one queue, run in submission order on the
// engine's thread: a push's step, the phases of a registration, a param group's registration or
// change, a pull's read. A job queues its device work on the backend (in stream order: on a GPU,
// the apply stream) and returns at once; the engine then runs the next job, so step N+1 is
// queued while step N still runs. A second thread, the completion path, waits for each job's
// device work in the same order and then runs the job's callback: pushes are acknowledged there,
// and the version and steps that readers see advance there. No gRPC thread waits for a kernel.
//
// Readers never wait for a job or the device: view() is an immutable ShardView, swapped by the
// engine when a registration or group change commits; version() and Steps() read the progress
// published by the completion path, under a lock held only to copy a few numbers.
//
// Retries: a tracked push (client_id, sequence_number) is checked against the RetryTable when its
// step is about to be queued (the authoritative check); the service also checks it when the
// push's header arrives, so that most retries are answered before their payload is read.
//
// Consistency (consistency.h): in async mode every push is its own step; bounded mode refuses
// a push whose staleness exceeds the bound, and may scale its step's lr; sync mode sums each
// push into the round of its base_version (engine_rounds.cc) and steps once per round. Staleness
// is measured against the version the job queue has reached (steps queued, not yet published).
//
// Faults: an error from the backend that is not an expected one (INTERNAL: the device failed)
// is reported to the ShardFault; the job gets INTERNAL, and every job after it gets the fault's
// UNAVAILABLE without touching the backend (docs/errors.md).
//
// Callbacks (`done`) run on the completion thread, except where a method says otherwise, and
// must not block. Each runs exactly once, also when the engine is destroyed: the destructor runs
// every job already submitted, waits for their device work, runs their callbacks, then stops;
// jobs submitted during or after that fail with UNAVAILABLE.
//
// Usage:
//   UpdateEngine engine(MakeCpuBackend({}), &fault, &retries);
//   engine.Step(&push, [](absl::StatusOr<StepResult> r) { ... acknowledge ... });
//   std::shared_ptr<const ShardView> view = engine.view();
#ifndef FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_
#define FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "common/notification.h"
#include "kernels/backend.h"
#include "kernels/hashed_rows.h"
#include "server/checkpoint/snapshot.h"
#include "server/engine/consistency.h"
#include "server/engine/shard_fault.h"
#include "server/schema/hyperparameters.h"
#include "server/store/buffer_set.h"
#include "server/store/retry_table.h"
#include "server/store/shard_view.h"

namespace fusedps {

// The rows of one embedding table in a push (kernels/backend.h: TableRows), as fp32.
struct ReadyTableRows {
  uint32_t tensor = 0;  // A table of the view (TensorMeta::table).
  // Row indices (dense ids; checked against the table by the step), or any int64 keys (a
  // hashed table: the step finds or makes their slots).
  std::vector<int64_t> keys;
  std::vector<float> grads;  // [keys.size(), dim] row-major.
};

// A push whose chunks have all arrived and passed their checks.
struct ReadyPush {
  std::string client_id;
  uint64_t sequence_number = 0;
  std::vector<uint32_t> tensors;       // Indices in the view.
  std::vector<uint64_t> grad_offsets;  // Into grads, in elements (multiples of 8).
  const void* grads = nullptr;         // Staging; owned by the caller until `done` runs.
  GradDType grad_dtype = GradDType::kFloat32;
  float grad_scale = 0.0f;    // <= 0: none.
  bool grads_finite = true;   // Checked for non-finite values as they arrived.
  uint64_t grad_bytes = 0;    // Payload received, for the reply.
  uint64_t base_version = 0;  // PushHeader.base_version.
  absl::Time arrived;         // Its first header arrived (for sync round timings).
  absl::Time received;        // Its last byte arrived.
  // Embedding tables stepped with the tensors, each at most once and none of `tensors`. Their
  // bad keys or grads fail the push with the backend's INVALID_ARGUMENT, nothing applied. In
  // sync mode a round steps the rows of all its members (UpdateEngine::RoundTables); a push
  // whose keys would bring a hashed table's unique keys in the round above its capacity is
  // refused with INVALID_ARGUMENT.
  std::vector<ReadyTableRows> tables;
};

struct StepResult {
  PushReply reply;
  // For a step that ran: the device time of its kernels, and how long the device waited for
  // its gradient copies once it got to it (WorkDone). 0 for a skipped step or a duplicate.
  double device_seconds = 0;
  double copy_wait_seconds = 0;
  // Whether this push's reply accounts for the step (fusedps_optimizer_steps_total): every
  // push's in async and bounded modes, one pusher's per sync round.
  bool counts_step = true;
  // Per table of the push (ReadyPush::tables, in order), for an applied step: the rows a hashed
  // table evicted (0 for a dense-id table; in a sync round, counted at the first member that
  // named the table).
  std::vector<uint64_t> table_evictions = {};
};

// A write of fp32 initial values into a tensor that a registration is adding.
struct ParamWrite {
  uint32_t tensor = 0;
  uint64_t offset = 0;  // In elements.
  const float* values = nullptr;
  uint64_t count = 0;
};

// A pull's read of one field of whole tensors (ReadRequest), into host memory or a snapshot.
struct ReadJob {
  TensorField field = TensorField::kParam;
  bool param_copy = false;
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> dst_offsets;  // Bytes.
  void* dst = nullptr;                // Host memory; ignored with snapshot_bytes > 0.
  uint64_t snapshot_bytes = 0;        // > 0: read into a snapshot of this size, allocated here.
  bool stored = false;         // The stored form (ReadRequest::stored), else fp32 (or the copy's).
  bool dst_on_device = false;  // dst is a device workspace's memory (ReadRequest's).
};

// A lookup: rows of one field of one embedding table of the view, by key, as fp32.
struct RowsJob {
  uint32_t tensor = 0;
  TensorField field = TensorField::kParam;  // kParam, kExpAvg or kExpAvgSq.
  std::vector<int64_t> keys;
};

struct RowsResult {
  uint64_t version = 0;     // The version the read saw.
  int64_t step = 0;         // The table's step at that version.
  std::vector<float> rows;  // [keys.size(), dim] row-major, in key order.
  // A hashed table's keys it did not hold (their rows are the initializer's); 0 for dense ids.
  uint64_t misses = 0;
};

struct ReadResult {
  uint64_t version = 0;        // The version the read saw.
  std::vector<int64_t> steps;  // Of ReadJob::tensors, at that version.
  void* snapshot = nullptr;    // The snapshot read into (free it with FreeSnapshot), or null.
};

// New values and steps for some registered tensors, loaded into a running shard (LoadState).
// The caller has checked that the writes cover each (tensor, field) it loads exactly once.
struct StateLoad {
  // fp32 values (param_copy false) in host memory, best the staging arena (page-locked on a
  // GPU backend), unchanged until the load's `done` runs. Tensors are indices of the view.
  std::vector<WriteRequest> writes;
  std::vector<uint32_t> tensors;  // The tensors whose step is set, each once,
  std::vector<int64_t> steps;     // to these steps (>= 0).
};

// A push's gradients as a StepRequest (checked for finiteness as they arrived).
StepRequest GradsOf(const ReadyPush& push);

class UpdateEngine {
 public:
  template <typename T>
  using Done = std::function<void(absl::StatusOr<T>)>;

  // REQUIRES: fault, retries and observer (may be null) outlive the engine; consistency is
  // valid (ValidateConsistency).
  UpdateEngine(std::unique_ptr<OptimizerBackend> backend, ShardFault* fault, RetryTable* retries,
               ConsistencyOptions consistency = {}, ConsistencyObserver* observer = nullptr);
  ~UpdateEngine();
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  // --- Readers: any thread; never wait for a job or the device. ---
  std::shared_ptr<const ShardView> view() const ABSL_LOCKS_EXCLUDED(view_mu_);
  // The version as of the last completed step.
  uint64_t version() const ABSL_LOCKS_EXCLUDED(progress_mu_);
  // ShardCut::generation as of the jobs run so far (a checkpoint of this generation holds the
  // shard as it is).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // The version and the steps of `tensors` (indices of the current view), read together.
  uint64_t Steps(absl::Span<const uint32_t> tensors, std::vector<int64_t>* steps) const
      ABSL_LOCKS_EXCLUDED(progress_mu_);
  // The rows hashed table `tensor` holds, as of the steps queued; 0 for another tensor.
  uint64_t HashedRowsInUse(uint32_t tensor) const ABSL_LOCKS_EXCLUDED(progress_mu_);

  // The model's buffers as of the last write run (a write has no device work).
  std::shared_ptr<const BufferSet> buffers() const ABSL_LOCKS_EXCLUDED(view_mu_);

  const ConsistencyOptions& consistency() const { return consistency_; }
  // The checks a push's header can pass or fail before its payload is read, against the
  // published version (which only grows, so a
  // refusal here is final): in sync mode a client_id (INVALID_ARGUMENT) and a base_version not
  // below the version (ABORTED); in bounded mode a staleness within the bound (ABORTED).
  // Thread-safe.
  absl::Status AdmitPush(absl::string_view client_id, uint64_t base_version) const;

  // --- Jobs, run in submission order. ---
  // A push (or its retry's reply): one optimizer step in async and bounded modes; in sync mode
  // a share of its round's step (done runs once the round's step ran). `consumed` (may be
  // null) runs on the completion thread, before `done`, once the push's grads are no longer
  // read: the caller may reuse their memory then (in sync mode long before the round ends).
  // Errors: ABORTED for a stale sequence number, or a base_version the mode refuses (sync: not
  // the round's version, or a second push of one client_id in a round; bounded: too stale);
  // INVALID_ARGUMENT for a sync push without client_id;
  // FAILED_PRECONDITION for a sync round whose tensors were registered during it; INTERNAL for
  // a device fault; UNAVAILABLE after one, and for a round still open when the engine stops.
  void Step(const ReadyPush* push, Done<StepResult> done, std::function<void()> consumed = nullptr);
  // `done` runs on the engine thread once the change is queued (later steps use it).
  // RegisterParamGroup's value is true when created, false when an identical group existed;
  // ALREADY_EXISTS for a group with other hyperparameters.
  void RegisterParamGroup(ParamGroupSpec group, Done<bool> done);
  // The group after the change of the fields `update` sets; NOT_FOUND, INVALID_ARGUMENT
  // (UpdatedHyperparameters).
  void SetHyperparameters(std::string group, v1::Hyperparameters update, Done<ParamGroupSpec> done);
  // Replaces or adds buffers (BufferSet::Merged's errors, all or nothing), in stream order: a
  // checkpoint's cut after this job holds them, one before does not. Versions and steps do not
  // change. `done` runs on the engine thread, with the version of the steps queued before.
  void WriteBuffers(std::vector<BufferValue> writes, Done<uint64_t> done);
  // A registration in phases: Begin adds the tensors to the backend (invisible to readers and
  // pushes), WriteParams fills their values, Commit makes them visible (a new view), Abort
  // removes them. One registration at a time (the caller serializes them). `done` runs on the
  // engine thread. Begin's value is the first new index; RESOURCE_EXHAUSTED when memory runs
  // out (nothing added). Commit's value is the version.
  void BeginRegistration(std::vector<TensorMeta> tensors, Done<uint32_t> done);
  void WriteParams(std::vector<ParamWrite> writes, Done<bool> done);
  // Commit also takes `plan_hash` as the shard's when it has none (ShardView::plan_hash).
  void CommitRegistration(std::string plan_hash, Done<uint64_t> done);
  void AbortRegistration(Done<bool> done);
  // A pull's read, in stream order after the steps submitted before it. RESOURCE_EXHAUSTED
  // when a snapshot cannot be allocated; FAILED_PRECONDITION as OptimizerBackend::Read.
  void Read(ReadJob job, Done<ReadResult> done);
  // Frees a snapshot of an earlier Read, after the work queued before.
  void FreeSnapshot(void* snapshot);
  // A lookup of table rows (engine_tables.cc), in stream order after the steps submitted
  // before it. INVALID_ARGUMENT for a tensor of the view that is not a table, and the
  // backend's (a key outside [0, rows), naming it); UNIMPLEMENTED on a backend without tables.
  // A hashed table's key it does not hold reads as its initializer's row (zeros for the
  // moments), counted in RowsResult::misses; a lookup creates and evicts nothing.
  void ReadRows(RowsJob job, Done<RowsResult> done);

  // A checkpoint's snapshot, at the point of this job in stream order (engine_checkpoint.cc).
  // Without `fenced`, the values of SnapshotLayout(the view, param_copy_dtype()) are copied
  // into `buffer` (host memory, AllocateHostBuffer), on the stream between two steps, and
  // `done` runs once they are there; later steps go on meanwhile. OUT_OF_RANGE when the view
  // needs more than `buffer_bytes` (a registration came in between). With `fenced`, nothing is
  // copied: `done` gets a fence through which the caller reads the values piece by piece,
  // and the engine runs no job until the fence is destroyed. `done` runs on the completion
  // thread; it may hand the snapshot to another thread.
  void Snapshot(void* buffer, uint64_t buffer_bytes, bool fenced, Done<CheckpointSnapshot> done);
  // Loads a whole shard into an engine that has none yet (no tensors, only "default" group):
  // groups and tensors, then the values batch by batch as `source` has them ready, then steps,
  // version and the retry table; only then is the shard published. `done` runs on the engine
  // thread with the version. The engine thread waits on `source` meanwhile (a restore runs
  // before serving). FAILED_PRECONDITION when the shard is not empty. When the source fails
  // (its error, e.g. DATA_LOSS), or hands out more or fewer values than the shard has
  // (DATA_LOSS), or the backend refuses a write or runs out of memory (INVALID_ARGUMENT,
  // FAILED_PRECONDITION, RESOURCE_EXHAUSTED), the restore is undone: the engine is empty again
  // and may restore another checkpoint. INTERNAL for a device fault (the engine is unusable).
  // REQUIRES: shard and source outlive `done`.
  void Restore(const RestoredShard* shard, RestoreSource* source, Done<uint64_t> done);
  // Overwrites values and steps of registered tensors (engine_checkpoint.cc), in stream order:
  // after the steps submitted before it, before later ones. All or nothing: every write and
  // step is checked before the first is queued. Params are written with their param copy (as
  // registration writes them); fields not written keep their values. The version advances by
  // 1; `done` gets it on the completion thread once the writes are done, when the readers see
  // the new version and steps. Errors: INVALID_ARGUMENT for a write outside a tensor of the
  // view, a param copy write, a step < 0 or tensors and steps of different lengths;
  // FAILED_PRECONDITION for max_exp_avg_sq of a tensor whose group has no amsgrad, and in sync
  // mode while a round holds pushes (their sums were taken from the values the load replaces);
  // INTERNAL for a device fault, UNAVAILABLE after one. REQUIRES: `load` outlives `done`.
  void LoadState(const StateLoad* load, Done<uint64_t> done);
  // Page-locked host memory for Snapshot's buffer and a restore's batches (thread-safe;
  // RESOURCE_EXHAUSTED).
  absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) {
    return backend_->AllocateHostBuffer(bytes);
  }
  void FreeHostBuffer(void* buffer) { backend_->FreeHostBuffer(buffer); }

  // Calls submit(done) and blocks until the job runs `done`, for the callers that may block
  // (synchronous handlers).
  template <typename T, typename Submit>
  static absl::StatusOr<T> Wait(Submit submit) {
    Notification ready;
    absl::StatusOr<T> result;
    submit([&](absl::StatusOr<T> r) {
      result = std::move(r);
      ready.Notify();
    });
    ready.WaitForNotification();
    return result;
  }

  // --- The backend's thread-safe parts. Device errors here are reported as faults. ---
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes);
  // A push's ranges of a device workspace into the staging mirror, checked (backend.h); waits
  // for the copies (a few microseconds per megabyte), not for any step.
  absl::StatusOr<GradCheck> CopyDeviceToStaging(absl::Span<const DeviceStagingCopy> copies,
                                                GradDType dtype);
  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes, void* dst);
  std::map<std::string, uint64_t> launch_counts() const { return backend_->launch_counts(); }
  std::map<std::string, uint64_t> memory_bytes() const { return backend_->memory_bytes(); }
  std::string backend_name() const { return backend_->name(); }
  std::string device() const { return backend_->device(); }
  ParamCopyDType param_copy_dtype() const { return backend_->param_copy_dtype(); }
  // Only before serving (the engine thread has not touched the backend yet).
  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) {
    return backend_->AllocateStagingArena(bytes);
  }

 private:
  // What the completion path does for a job: wait for `marker`, then run `finish`.
  struct Completion {
    Marker marker = 0;
    std::function<void(absl::StatusOr<WorkDone>)> finish;
  };
  using Work = std::function<void()>;  // Runs on the engine thread; may call Complete.

  void Submit(Work work, const std::function<void(const absl::Status&)>& fail)
      ABSL_LOCKS_EXCLUDED(jobs_mu_);
  void Complete(Completion completion) ABSL_LOCKS_EXCLUDED(completions_mu_);
  // A backend error (on any thread): a fault unless expected_ok and it is an expected code.
  absl::Status Checked(absl::Status status, bool expected_ok = false);
  // Restore's part on the engine thread once the tensors exist (from `first`; `view` has them
  // as the shard's first ones): every value from `source`, checked against SnapshotLayout's
  // fields for completeness, then the steps (engine_checkpoint.cc).
  absl::Status RestoreValues(const RestoredShard& shard, const ShardView& view,
                             RestoreSource* source, uint32_t first);
  // Queues one write of host values, for a restore or a load: fp32 params through WriteParams
  // when the backend must derive its param copy from them (`derive_copy`), else Write.
  absl::Status WriteValues(const WriteRequest& write, bool derive_copy);
  // LoadState's checks, against the current view, before anything is written.
  absl::Status CheckLoad(const StateLoad& load) const;
  // The sync round being gathered (engine_rounds.cc); engine thread only.
  struct RoundMember {
    const ReadyPush* push;
    Done<StepResult> done;
  };
  struct Round {
    uint64_t id = 0;  // Counts rounds; the timer names the round it closes.
    std::vector<RoundMember> members;
    // The shard's tensor count when the round opened, and which of those tensors a member
    // pushed (summed into the accumulator): the round's step updates those only.
    uint32_t tensor_count = 0;
    std::vector<bool> pushed;
    // The unique keys the members pushed to each hashed table (their union must fit its
    // capacity: the round's step plans them together).
    absl::flat_hash_map<uint32_t, absl::flat_hash_set<int64_t>> hashed_keys;
  };
  // The round after `round`, empty.
  static Round NextRound(const Round& round) {
    Round next;
    next.id = round.id + 1;
    return next;
  }
  // The retry table's verdict on a push, in its job: true when the push is new (the caller
  // applies it); else it was answered (an earlier reply, a stale sequence number's ABORTED, or
  // the fault's error), `consumed` first.
  bool BeginPush(const ReadyPush* push, const Done<StepResult>& done,
                 const std::function<void()>& consumed);
  // Answers a push through the completion path: `consumed`, then `done`.
  void Answer(const Done<StepResult>& done, const std::function<void()>& consumed,
              absl::StatusOr<StepResult> result);
  // Step's job in async and bounded modes.
  void StepJob(const ReadyPush* push, const Done<StepResult>& done,
               const std::function<void()>& consumed);
  // A hashed table's part of a step (engine_tables.cc): its keys' slots, and the rows it
  // creates, from the table's index; the plan is committed once the step is queued, applied.
  struct HashedRowsStep {
    uint32_t tensor = 0;
    size_t position = 0;  // Its table's index in ReadyPush::tables.
    HashedRowIndex::SlotPlan plan;
    std::vector<int64_t> slots;      // Per key of the push (duplicates too), its slot.
    std::vector<int64_t> init_rows;  // The slots of plan.created, and their initial params.
    std::vector<float> init_params;
  };
  // Plans the slots of a hashed table's rows (changes nothing). INVALID_ARGUMENT naming the
  // table: more unique keys than its capacity.
  absl::StatusOr<HashedRowsStep> PlanHashedRows(const ReadyTableRows& rows,
                                                const TensorMeta& meta) const;
  // The tables' part of a step (engine_tables.cc): the backend's TableRows (pointing into the
  // ReadyTableRows and `hashed`, which must outlive the step's marker) and the tables stepped.
  struct TablesStep {
    std::vector<TableRows> rows;
    std::vector<uint32_t> tensors;
    std::shared_ptr<std::vector<HashedRowsStep>> hashed =
        std::make_shared<std::vector<HashedRowsStep>>();
  };
  // Plans a step's tables (each at most once), changing nothing: a hashed table's slots through
  // PlanHashedRows. Its errors are the push's (INVALID_ARGUMENT) or a broken index (INTERNAL).
  absl::StatusOr<TablesStep> PlanTables(absl::Span<const ReadyTableRows> tables) const;
  // Once the step that carried `step` is queued and applied (not skipped): the hashed tables'
  // slots are theirs, stamped with the tables' new steps. Returns the rows each table of the
  // planned span evicted (0 for a dense-id table).
  std::vector<uint64_t> CommitTables(const TablesStep& step, size_t table_count);
  // Sync mode: per hashed table of a push, the unique keys it adds to the round.
  using RoundKeys = std::vector<std::pair<uint32_t, std::vector<int64_t>>>;
  // The keys a push would add to the round, or INVALID_ARGUMENT, naming the table and its
  // capacity, when they would bring the round's unique keys of a hashed table above it.
  // Changes nothing: AddRoundKeys records them once the push has joined the round.
  absl::StatusOr<RoundKeys> CheckRoundKeys(const ReadyPush& push) const;
  void AddRoundKeys(RoundKeys keys);
  // Sync mode's job: adds the push to the round (engine_rounds.cc).
  void Contribute(const ReadyPush* push, const Done<StepResult>& done,
                  const std::function<void()>& consumed);
  // Queues the round's step with the members it has and answers them once it ran.
  void CloseRound(bool timed_out);
  // The round's rows of each table its members pushed, in tensor order: the members' rows one
  // after another in member order, each divided by its push's grad_scale (as Accumulate
  // divides the dense gradients), so that the step's sums over duplicate keys are the round's.
  // A table a member named without rows is there too, empty (stepped, as in async mode).
  static std::shared_ptr<std::vector<ReadyTableRows>> RoundTables(
      const std::vector<RoundMember>& members);
  // Per member, per table of its push: the rows the round's step evicted from that table
  // (`evictions`, per table of `merged`), counted at the first member that names the table.
  static std::vector<std::vector<uint64_t>> MemberEvictions(
      const std::vector<RoundMember>& members, const std::vector<ReadyTableRows>& merged,
      const std::vector<uint64_t>& evictions);
  // The replicas of the last kReplicaRounds rounds that are not among `members` (at most 64,
  // by name), and records the members as of this round.
  std::vector<std::string> MissingReplicas(const std::vector<RoundMember>& members);
  // Fails the members of the open round with `status` (the engine stops).
  void FailRound(const absl::Status& status);
  // The reply of a push's or a round's step once it is queued: advances the queued version
  // (unless skipped) and the generation.
  PushReply Advance(const StepOutcome& outcome);
  // Reports a push refused for its version to the observer: its staleness, and why.
  void Dropped(uint64_t tau, absl::string_view reason) const;
  void RunRoundTimer() ABSL_LOCKS_EXCLUDED(timer_mu_);
  void ArmRoundTimer(uint64_t round, absl::Time deadline) ABSL_LOCKS_EXCLUDED(timer_mu_);
  void RunJobs() ABSL_LOCKS_EXCLUDED(jobs_mu_, completions_mu_);
  void RunCompletions() ABSL_LOCKS_EXCLUDED(completions_mu_);
  void Publish(uint64_t version, absl::Span<const uint32_t> stepped)
      ABSL_LOCKS_EXCLUDED(progress_mu_);

  const std::unique_ptr<OptimizerBackend> backend_;
  ShardFault* const fault_;
  RetryTable* const retries_;
  const ConsistencyOptions consistency_;
  ConsistencyObserver* const observer_;  // May be null.

  class Fence;

  // Engine thread only.
  uint64_t queued_version_ = 0;
  std::atomic<uint64_t> generation_{0};      // ShardCut::generation; written by the engine thread.
  uint32_t pending_first_ = 0;               // The registration in progress: its first index,
  std::vector<TensorMeta> pending_tensors_;  // and its tensors.
  // The hashed tables' slot indexes (kernels/hashed_rows.h), by tensor index: made when their
  // registration commits or by Restore, changed only by their steps, read by lookups (which
  // count) and snapshots, all jobs of this thread.
  absl::flat_hash_map<uint32_t, HashedRowIndex> hashed_;
  Round round_;
  // sync mode: each client_id that pushed to one of the last kReplicaRounds rounds, and the
  // last round it pushed to (Round::id): the replicas a round that times out waited for.
  static constexpr uint64_t kReplicaRounds = 8;
  std::map<std::string, uint64_t> replica_rounds_;

  // When the last accumulation's work was done: completion thread only.
  absl::Time last_accumulated_;

  // The round timer (sync mode with a round timeout): closes round timer_round_ at
  // timer_deadline_ through a job.
  Mutex timer_mu_;
  CondVar timer_cv_;
  uint64_t timer_round_ ABSL_GUARDED_BY(timer_mu_) = 0;  // 0: none armed.
  absl::Time timer_deadline_ ABSL_GUARDED_BY(timer_mu_);
  bool timer_stop_ ABSL_GUARDED_BY(timer_mu_) = false;
  std::thread timer_thread_;  // Runs only in sync mode with a timeout.

  // Guards view_ and buffers_ (the pointers; views and buffer sets are immutable), which
  // only the engine thread swaps.
  mutable Mutex view_mu_;
  std::shared_ptr<const ShardView> view_ ABSL_GUARDED_BY(view_mu_);
  std::shared_ptr<const BufferSet> buffers_ ABSL_GUARDED_BY(view_mu_);

  mutable SharedMutex progress_mu_;
  uint64_t version_ ABSL_GUARDED_BY(progress_mu_) = 0;
  std::vector<int64_t> steps_ ABSL_GUARDED_BY(progress_mu_);  // By tensor index.
  // The rows each hashed table holds (hashed_'s rows_in_use), as of the steps queued.
  absl::flat_hash_map<uint32_t, uint64_t> hashed_rows_in_use_ ABSL_GUARDED_BY(progress_mu_);

  Mutex jobs_mu_;
  CondVar jobs_cv_;
  std::deque<Work> jobs_ ABSL_GUARDED_BY(jobs_mu_);
  bool stopping_ ABSL_GUARDED_BY(jobs_mu_) = false;

  Mutex completions_mu_;
  CondVar completions_cv_;
  std::deque<Completion> completions_ ABSL_GUARDED_BY(completions_mu_);
  bool jobs_done_ ABSL_GUARDED_BY(completions_mu_) = false;  // No more completions.

  std::thread completion_thread_;
  std::thread engine_thread_;  // Last: started once everything above exists.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_
