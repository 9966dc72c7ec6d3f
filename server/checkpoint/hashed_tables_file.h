// hashed_tables_file.h: a checkpoint's hashed embedding tables (docs/checkpoints.md): which key
// holds which slot of each hashed table, and since which step, beside the values that the data
// files hold as for any tensor. The manifest's Tensor.hashed holds each table's initializer and
// its index's counters; the file kHashedTablesFileName holds, per hashed table `t`, the I64
// entries "t.slot_keys" and "t.slot_stamps" of shape [capacity] (a free slot: key 0, stamp -1).
// Together they are a HashedRowIndexState (kernels/hashed_rows.h), so that a restore continues
// exactly as the shard would have: the same slots, the same eviction order, the same counters.
//
// Thread safety: free functions of their arguments.
#ifndef FUSEDPS_SERVER_CHECKPOINT_HASHED_TABLES_FILE_H_
#define FUSEDPS_SERVER_CHECKPOINT_HASHED_TABLES_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "fusedps/v1/checkpoint.pb.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/snapshot.h"

namespace fusedps::checkpoint {

inline constexpr char kHashedTablesFileName[] = "hashed_tables.safetensors";

// The manifest's Tensor.hashed of a hashed table: its keys' options and its index's counters.
v1::CheckpointManifest::HashedTable HashedTableToManifest(const HashedKeys& keys,
                                                          const HashedRowIndexState& index);

// Writes the slots of the cut's hashed tables (ShardCut::hashed_tables, all of its view's
// hashed tables) to `path`. Errors: the file's (safetensors::WriteFile).
absl::StatusOr<safetensors::WriteResult> WriteHashedTables(const ShardCut& cut,
                                                           const std::string& path);

// The hashed options of a manifest's table (Tensor.hashed), checked: DATA_LOSS for an init_std
// that is not a finite fp32 value >= 0 (the message names init_std; the caller says where).
absl::StatusOr<HashedKeys> HashedKeysFromManifest(
    const v1::CheckpointManifest::HashedTable& hashed);

// Reads the checkpoint's hashed-table file whole, checks its CRC-32 against the manifest's, and
// sets shard->hashed_tables for every tensor of shard->tensors with hashed keys, from the file's
// slots and the manifest's counters. Errors: DATA_LOSS naming the file for a missing file, a
// wrong CRC, entries other than exactly two per hashed table of shape [capacity] and dtype I64,
// or slots that make no index (HashedRowIndex::Import's checks: a repeated key, a stamp above
// the table's step, counters that disagree).
absl::Status ReadHashedTables(const Loaded& checkpoint, const v1::CheckpointManifest& manifest,
                              RestoredShard* shard);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_HASHED_TABLES_FILE_H_
