// fusedps_c.h: a C ABI over the C++ client (fusedps/client.h), for the Python package's native
// transport (client/python/fusedps/_native.py, through ctypes).
//
// Why a C ABI and not a CPython extension: a C ABI loads into any CPython version through ctypes
// (the trainer's Python need not be the one the library was built for), needs no Python headers,
// and ctypes releases the GIL for the whole call, so a push moves at the C++ client's speed while
// other Python threads run.
//
// Conventions:
//  * Every function that can fail returns a gRPC status code (0 = OK) and, when it is not 0,
//    writes a NUL-terminated message into error->message (truncated to fit).
//  * Strings are NUL-terminated UTF-8. Arrays are given as a pointer and a count.
//  * Dtype and field numbers are those of the proto enums (fusedps.v1.DType: 1 float32,
//    2 bfloat16, 3 float16; fusedps.v1.TensorField: 1 param, 2 exp_avg, 3 exp_avg_sq,
//    4 max_exp_avg_sq).
//
// Thread safety: one fusedps_client may be used by one thread at a time (as fusedps::Client).
// Lifetimes: a client lives from fusedps_client_create to fusedps_client_destroy; every pointer
// passed to a call is read during that call only.
#ifndef FUSEDPS_CLIENT_CAPI_FUSEDPS_C_H_
#define FUSEDPS_CLIENT_CAPI_FUSEDPS_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped on any change of the functions or structs below; the Python side checks it.
#define FUSEDPS_C_API_VERSION 11

// The library is built with hidden visibility; only these functions are exported.
#define FUSEDPS_C_EXPORT __attribute__((visibility("default")))

typedef struct fusedps_client fusedps_client;

typedef struct fusedps_error {
  int32_t code;  // gRPC status code; 0 when the call succeeded.
  // 1 when this library found the error in the caller's arguments (a NULL pointer, a bad dtype
  // or field, fusedps_pull's shape check); 0 for the status of the call itself (the server's or
  // the transport's).
  int32_t local;
  char message[1024];  // The status message, NUL-terminated.
} fusedps_error;

typedef struct fusedps_client_options {
  uint64_t max_chunk_bytes;     // Payload bytes per request message (ClientOptions).
  int32_t streams;              // Concurrent calls, each on its own connection, 1..64.
  double timeout_seconds;       // Per-call deadline base; <= 0: no deadline at all.
  double min_bytes_per_second;  // Added to the deadline per payload byte; 0: none.
  // Transport security and the bearer token, as ClientOptions' fields of the same names: NULL
  // or "" leaves a string unset. A token file is read by the caller and given as `token`.
  int32_t tls;                // Nonzero: TLS (implied by any tls_* file).
  const char* tls_ca_file;    // PEM roots the server's certificate must chain to.
  const char* tls_cert_file;  // PEM client certificate (mTLS), with tls_key_file.
  const char* tls_key_file;   // Its PEM private key.
  const char* token;          // Sent on every call as `authorization: Bearer TOKEN`.
  const char* model;          // The model every call is about (ClientOptions::model); NULL: "".
} fusedps_client_options;

typedef struct fusedps_push_header {
  const char* client_id;     // "" disables retry detection (streams > 1 picks one).
  uint64_t sequence_number;  // 0 disables retry detection (streams > 1 picks one).
  int32_t grad_dtype;        // Wire dtype: 1 float32, 2 bfloat16, 3 float16.
  float grad_scale;          // > 0: the server divides the gradients by it; <= 0: none.
  uint64_t base_version;
  const char* plan_hash;  // "" for an unsharded server.
  uint32_t max_parts;  // The most calls the push travels as (PushOptions::max_parts); 0: streams.
} fusedps_push_header;

typedef struct fusedps_push_result {
  uint64_t version;
  int32_t step_skipped;
  char skip_reason[64];
  uint32_t tensors_updated;
  uint64_t grad_bytes;
  int32_t duplicate;
  uint32_t round_workers;
  int32_t round_timed_out;
  char missing_replicas[1024];  // Comma-separated client_ids, cut to fit.
  uint64_t pulled_version;      // The commit's pull's version (fusedps_push_commit_pull); or 0.
} fusedps_push_result;

FUSEDPS_C_EXPORT int32_t fusedps_c_api_version(void);

// Makes a client of `target` ("host:port"); connects lazily. NULL with *error set
// (INVALID_ARGUMENT) for options outside fusedps::ClientOptions' REQUIRES, tls_cert_file
// without tls_key_file (or the reverse), or a TLS file that cannot be read.
FUSEDPS_C_EXPORT fusedps_client* fusedps_client_create(const char* target,
                                                       const fusedps_client_options* options,
                                                       fusedps_error* error);
FUSEDPS_C_EXPORT void fusedps_client_destroy(fusedps_client* client);  // NULL is a no-op.

// Connects every stream's channel, at most `timeout_seconds` in all
// (fusedps::client::Client::WaitForReady). DEADLINE_EXCEEDED when they have not all connected.
FUSEDPS_C_EXPORT int32_t fusedps_client_wait_ready(fusedps_client* client, double timeout_seconds,
                                                   fusedps_error* error);

// Pushes begun and pulls into memory made from now on go through the same-host workspace
// `workspace_id` (proto OpenWorkspace), mapped here at [data, data + bytes): pieces and targets
// inside it travel as their places (fusedps::client::Client::SetWorkspace). A NULL or empty id
// stops that. The caller keeps the workspace open and mapped while they run.
FUSEDPS_C_EXPORT int32_t fusedps_client_set_workspace(fusedps_client* client,
                                                      const char* workspace_id, const void* data,
                                                      uint64_t bytes, fusedps_error* error);

// One push of `count` tensors: names[i] with numels[i] float32 gradients at grads[i] (host
// memory, row-major), converted to header->grad_dtype on the way out. Applied by the server as
// one atomic AdamW step (fusedps::Client::PushGradients).
FUSEDPS_C_EXPORT int32_t fusedps_push_gradients(fusedps_client* client,
                                                const fusedps_push_header* header, size_t count,
                                                const char* const* names, const float* const* grads,
                                                const uint64_t* numels, fusedps_push_result* result,
                                                fusedps_error* error);

// Pulls one field of `count` named tensors, all at one version, in `dtype` (1 float32 or
// 2 bfloat16) on the wire, into dst[i] (host memory for the tensor's elements as floats;
// bfloat16 values are widened exactly). Tensor i's expected shape is ranks[i] dims, taken in
// order from `dims` (all tensors' dims, concatenated). Writes the version to *version and each
// tensor's step to steps[i]. INVALID_ARGUMENT with error->local set, naming the tensor and both
// shapes, when a tensor's shape on the server differs (dst is then partly written).
FUSEDPS_C_EXPORT int32_t fusedps_pull(fusedps_client* client, int32_t dtype, int32_t field,
                                      size_t count, const char* const* names, float* const* dst,
                                      const uint64_t* ranks, const int64_t* dims, uint64_t* version,
                                      int64_t* steps, fusedps_error* error);

// A push sent a piece at a time and committed at the end (fusedps::client::PushTransaction):
// begin, write pieces of raw wire-dtype gradients (host memory that stays valid and unchanged
// until commit or cancel returns), then commit with the step's grad_scale, or cancel. One
// thread at a time per push; a push lives until fusedps_push_destroy.
typedef struct fusedps_push fusedps_push;

// Begins a push of `count` tensors (names[i], numels[i] elements); header->grad_scale is
// ignored (the commit carries it). Opens the push's calls, one part per stream. NULL with
// *error set for bad arguments.
FUSEDPS_C_EXPORT fusedps_push* fusedps_push_begin(fusedps_client* client,
                                                  const fusedps_push_header* header, size_t count,
                                                  const char* const* names, const uint64_t* numels,
                                                  fusedps_error* error);

// Queues `count` pieces: elements [offsets[i], offsets[i] + counts[i]) of tensor number
// tensors[i] (an index into the begun push's names), raw little-endian elements of the push's
// grad_dtype at data[i]. Returns without waiting for them to be sent. Errors: INVALID_ARGUMENT
// (local) for a piece outside its tensor; the status of a part that has failed already.
FUSEDPS_C_EXPORT int32_t fusedps_push_write(fusedps_push* push, size_t count,
                                            const uint64_t* tensors, const uint64_t* offsets,
                                            const uint64_t* counts, const void* const* data,
                                            fusedps_error* error);

// Commits the push with grad_scale (> 0: the server divides the gradients by it; <= 0: none)
// and waits for its reply. Errors: as fusedps_push_gradients.
FUSEDPS_C_EXPORT int32_t fusedps_push_commit(fusedps_push* push, float grad_scale,
                                             fusedps_push_result* result, fusedps_error* error);

// fusedps_push_commit, carrying a pull (PushTransaction::Commit's then_pull): once the step is
// applied the server writes tensor names[i]'s numels[i] values, in `dtype` (1 float32 or
// 2 bfloat16, the server's stored dtype), at dst[i], which lies in the push's workspace; then
// it replies, with the version read in result->pulled_version (0: answered from its retry
// table, nothing written). Errors: fusedps_push_commit's; INVALID_ARGUMENT for a push without a
// workspace, a bad dtype (local) or a target outside the workspace (then nothing is sent, and
// the push can only be cancelled).
FUSEDPS_C_EXPORT int32_t fusedps_push_commit_pull(
    fusedps_push* push, float grad_scale, int32_t dtype, size_t count, const char* const* names,
    void* const* dst, const uint64_t* numels, fusedps_push_result* result, fusedps_error* error);

// Cancels the push (nothing is applied) and waits until its memory is no longer read. Does
// nothing after a commit.
FUSEDPS_C_EXPORT void fusedps_push_cancel(fusedps_push* push);

// Cancels the push unless it was committed, and frees it. NULL is a no-op.
FUSEDPS_C_EXPORT void fusedps_push_destroy(fusedps_push* push);

// Pulls one field of `count` named tensors, all at one version, over one call on stream
// `stream` (modulo the client's streams), in `dtype` (1 float32 or 2 bfloat16), writing each
// tensor's numels[i] raw little-endian elements of that dtype to dst[i] (no conversion).
// Writes the version and each tensor's step. INVALID_ARGUMENT (local) naming a tensor whose
// element count on the server differs from numels[i] (dst is then partly written).
FUSEDPS_C_EXPORT int32_t fusedps_pull_into(fusedps_client* client, int32_t stream, int32_t dtype,
                                           int32_t field, size_t count, const char* const* names,
                                           void* const* dst, const uint64_t* numels,
                                           uint64_t* version, int64_t* steps, fusedps_error* error);

// A pipelined pull (fusedps/pipelined_pull.h): `groups` groups of tensors pulled over the
// clients' streams, `threads` at a time, in order, each landing as raw elements of `dtype` in
// the caller's memory; the caller waits for them group by group. The targets are given as flat
// arrays of `count` entries: group_of[i] (0..groups-1, nondecreasing), client_of[i] (an index
// into clients), names[i], dst[i], numels[i]; one call per (group, client). Lifetimes: every
// client, and the memory at every dst, outlive the pull (fusedps_pipelined_pull_destroy waits for
// the groups in flight; it cancels nothing). The arrays are read during the start call only.
// Thread safety: wait, landed, version and seconds may be called from several threads at once.
typedef struct fusedps_pipelined_pull fusedps_pipelined_pull;

// Returns NULL (and the error, INVALID_ARGUMENT) for NULL pointers, a bad dtype or field, a
// group or client index out of range, or groups out of order.
FUSEDPS_C_EXPORT fusedps_pipelined_pull* fusedps_pipelined_pull_start(
    fusedps_client* const* clients, size_t client_count, int32_t dtype, int32_t field,
    int32_t threads, size_t groups, size_t count, const uint64_t* group_of,
    const uint64_t* client_of, const char* const* names, void* const* dst, const uint64_t* numels,
    fusedps_error* error);

// Blocks until groups 0..group have landed; returns the first error among them (the pull's
// status, as fusedps_pull_into's: INVALID_ARGUMENT, local, naming a tensor of another size).
FUSEDPS_C_EXPORT int32_t fusedps_pipelined_pull_wait(fusedps_pipelined_pull* pull, int64_t group,
                                                     fusedps_error* error);

// The number of leading groups that have landed, without waiting.
FUSEDPS_C_EXPORT int64_t fusedps_pipelined_pull_landed(fusedps_pipelined_pull* pull);

// The highest version a landed group read from clients[client] (0 before one has).
FUSEDPS_C_EXPORT uint64_t fusedps_pipelined_pull_version(fusedps_pipelined_pull* pull,
                                                         size_t client);

// Seconds from the start to the last group that has landed so far.
FUSEDPS_C_EXPORT double fusedps_pipelined_pull_seconds(fusedps_pipelined_pull* pull);

// Waits for the groups in flight and frees the pull. NULL is ignored.
FUSEDPS_C_EXPORT void fusedps_pipelined_pull_destroy(fusedps_pipelined_pull* pull);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FUSEDPS_CLIENT_CAPI_FUSEDPS_C_H_
