// push_reactor.h (server internal): PushGradients on gRPC's callback API.
//
// Nothing here blocks a gRPC thread. A push's staging is reserved asynchronously (its streams
// are not read until the pool grants it: back-pressure); each message's chunks are checked,
// copied once into staging and sent on to the device as they arrive; the update engine's
// thread acknowledges the push once the step is back (the completion path).
//
// A push may travel as several parallel calls ("parts", PushHeader.part_index/part_count),
// which share one assembly, found by (client_id, sequence_number). It is applied once, when
// every part has ended well, and every part gets the same reply; a part that fails fails the
// push, and the others get ABORTED. A single call is an assembly of one part.
#ifndef FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_
#define FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_

#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/metrics/metrics.h"
#include "server/store/shard_store.h"
#include "server/ingest/staging_pool.h"
#include "server/engine/update_engine.h"

namespace fusedps {

class PushAssembly;

// The multi-part pushes being assembled, by (client_id, sequence_number). A push that failed
// stays known for a minute, so that its late parts are ABORTED rather than start it anew.
// A push whose parts have not all arrived within `part_wait` of its first fails with
// DEADLINE_EXCEEDED (every part that came gets it, and its staging goes back): a trainer that
// dies between parts cannot hold staging for ever. A thread checks once a second.
class PushAssemblies {
 public:
  explicit PushAssemblies(absl::Duration part_wait);
  ~PushAssemblies();  // Stops the checks; pushes still assembling are left to the server.
  PushAssemblies(const PushAssemblies&) = delete;
  PushAssemblies& operator=(const PushAssemblies&) = delete;

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
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<PushAssembly>> assemblies_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread checker_;
};

// What a push needs from the server. All outlive every call.
struct PushServices {
  ShardStore* store;
  UpdateEngine* engine;
  Metrics* metrics;
  StagingPool* staging;
  PushAssemblies* assemblies;
};

// The reactor of one PushGradients call; gRPC deletes it when the call is done.
// PushGradients is a raw method: `response` receives a serialized PushGradientsResponse, and
// the reactor reads serialized PushGradientsRequests (server/ingest/push_message.h).
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
    const PushServices& services);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_
