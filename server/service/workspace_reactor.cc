#include "server/service/workspace_reactor.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/tsan.h"
#include "server/service/convert.h"

namespace fusedps {
namespace {

class WorkspaceReactor final : public grpc::ServerWriteReactor<v1::OpenWorkspaceResponse> {
 public:
  WorkspaceReactor(grpc::CallbackServerContext* context, const v1::OpenWorkspaceRequest& request,
                   const ServiceContext& services)
      : context_(context), services_(services) {
    absl::StatusOr<std::shared_ptr<const Workspace>> opened = Open(request);
    // Finish and StartWrite, called here, write the reactor's own state, which OnDone deletes
    // on another thread after taking mu_: mu_ orders the two (gRPC's own order is invisible to
    // TSan).
    MutexLock lock(&mu_);
    if (!opened.ok()) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1)
          << "no workspace for " << context_->peer() << ": " << opened.status();
      ended_ = true;  // OnCancel, if it comes, must not finish the call again.
      FUSEDPS_HAPPENS_BEFORE(this);
      Finish(ToGrpc(opened.status()));
      return;
    }
    id_ = (*opened)->id();
    response_.set_workspace_id(id_);
    response_.set_path((*opened)->path());
    response_.set_bytes((*opened)->memory().size());
    response_.set_file_device((*opened)->file_device());
    response_.set_file_inode((*opened)->file_inode());
    if ((*opened)->on_device()) {
      response_.set_memory(v1::WORKSPACE_MEMORY_DEVICE);
      response_.set_cuda_ipc_handle((*opened)->ipc_handle());
      response_.set_device_uuid((*opened)->device_uuid());
    }
    FUSEDPS_HAPPENS_BEFORE(this);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    FUSEDPS_HAPPENS_AFTER(this);
    if (!ok) End(absl::CancelledError("the client left"));
    // Else the workspace stays open until the call is cancelled (OnCancel).
  }

  void OnCancel() override {
    FUSEDPS_HAPPENS_AFTER(this);
    End(absl::CancelledError("the workspace is closed"));
  }

  void OnDone() override {
    FUSEDPS_HAPPENS_AFTER(this);
    Close();  // Never left open, however the call ended.
    delete this;
  }

 private:
  absl::StatusOr<std::shared_ptr<const Workspace>> Open(const v1::OpenWorkspaceRequest& request) {
    Caller caller;
    if (absl::Status s = services_.Admit(*context_, Rpc::kOpenWorkspace, &caller); !s.ok()) {
      return s;
    }
    if (!IsLocalPeer(context_->peer())) {
      return absl::PermissionDeniedError(
          absl::StrCat("a workspace is for a caller on the server's host; this call comes from ",
                       context_->peer()));
    }
    WorkspaceMemory memory = WorkspaceMemory::kHost;
    switch (request.memory()) {
      case v1::WORKSPACE_MEMORY_HOST:
        break;
      case v1::WORKSPACE_MEMORY_DEVICE:
        memory = WorkspaceMemory::kDevice;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("memory = ", request.memory(), " is not a WorkspaceMemory"));
    }
    return services_.workspaces->Open(WorkspaceOwner(caller), request.bytes(), memory);
  }

  // Closes the workspace and ends the call. Once.
  void End(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    CloseLocked();
    FUSEDPS_HAPPENS_BEFORE(this);
    Finish(ToGrpc(status));
  }

  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    CloseLocked();
  }
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!id_.empty()) services_.workspaces->Close(id_);
    id_.clear();
  }

  grpc::CallbackServerContext* const context_;
  const ServiceContext services_;
  v1::OpenWorkspaceResponse response_;
  Mutex mu_;
  // Guarded by mu_ once the call runs: the open workspace, or empty.
  std::string id_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<v1::OpenWorkspaceResponse>* NewWorkspaceReactor(
    grpc::CallbackServerContext* context, const v1::OpenWorkspaceRequest* request,
    const ServiceContext& services) {
  return new WorkspaceReactor(context, *request, services);
}

}  // namespace fusedps
