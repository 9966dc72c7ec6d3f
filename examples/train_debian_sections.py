#!/usr/bin/env python3
"""Classifies Debian package descriptions into their Section with a fastText-style model whose
embedding table lives on a fusedps server, and trains the same model locally beside it.

The model (Joulin et al., "Bag of Tricks for Efficient Text Classification", 2016): the words
and word bigrams of a description, hashed into --buckets rows of an embedding table (the
hashing trick: a feature's row is crc32(feature) mod buckets, so the vocabulary needs no
dictionary), averaged (EmbeddingBag, mode "mean"), then one linear layer to the sections.
Through fusedps: fusedps.torch.RemoteEmbeddingBag with RemoteSparseAdam for the table (rows
looked up and pushed by key), fusedps.torch.RemoteAdamW for the linear layer. Locally:
torch.nn.EmbeddingBag(sparse=True) with torch.optim.SparseAdam, and torch.optim.AdamW. Both
start from the same weights and see the same batches.

    PYTHONPATH=build/python /usr/bin/python3 examples/train_debian_sections.py \\
        --target 127.0.0.1:50051

Data: the Packages lists of this machine's apt (/var/lib/apt/lists/*_Packages*, read with
apt-helper, which decompresses them; `apt-get update` makes them): each package's one-line
Description and its Section ("contrib/" and "non-free/" prefixes dropped), the --sections most
common sections, packages deduplicated by description. A package is in the test split when
crc32 of its name mod 10 is 0 (10%, the same on every machine).
Output: a line per epoch, then "RESULT {json}" with test_accuracy (fusedps),
reference_test_accuracy (local), max_abs_difference of the table rows, and the counts.
Exit status: 0 when both accuracies are >= --min-accuracy and within --max-accuracy-gap of each
other; 1 otherwise; 2 when this machine has no Packages lists.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import subprocess
import sys
import time
import zlib
from collections import Counter
from typing import List, Tuple

import torch

from fusedps.torch import RemoteAdamW, RemoteEmbeddingBag, RemoteSparseAdam

LISTS = "/var/lib/apt/lists/*_Packages*"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051", help="fusedps server host:port")
    p.add_argument("--lists", default=LISTS,
                   help="the Packages lists (a glob): compressed ones are read with apt-helper, "
                        "others as text (e.g. lists copied to a machine without apt)")
    p.add_argument("--buckets", type=int, default=1 << 20, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--sections", type=int, default=20, help="the most common sections kept")
    p.add_argument("--max-packages", type=int, default=0, help="0: all")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="debian.features", help="the table's name on the server")
    p.add_argument("--min-accuracy", type=float, default=0.5)
    p.add_argument("--max-accuracy-gap", type=float, default=0.01)
    return p.parse_args(argv)


def read_packages(lists: str) -> List[Tuple[str, str, str]]:
    """(name, section, description) of every package in the lists, first list first."""
    files = sorted(f for f in glob.glob(lists) if not f.endswith(".diff_Index"))
    packages = []
    for path in files:
        if path.endswith((".lz4", ".xz", ".gz", ".bz2", ".zst")):
            text = subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", path], check=True,
                                  capture_output=True).stdout.decode("utf-8", "replace")
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        for stanza in text.split("\n\n"):
            fields = dict(re.findall(r"^(Package|Section|Description): (.*)$", stanza, re.M))
            if len(fields) == 3:
                section = fields["Section"].split("/")[-1]
                packages.append((fields["Package"], section, fields["Description"]))
    return packages


def features(description: str, buckets: int) -> List[int]:
    """The description's words and word bigrams, hashed into [0, buckets)."""
    words = re.findall(r"[a-z0-9+#]+", description.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    return [zlib.crc32(g.encode()) % buckets for g in grams] or [0]


def dataset(args) -> Tuple[list, list, List[str]]:
    packages = read_packages(args.lists)
    seen, unique = set(), []
    for name, section, description in packages:
        if description not in seen:
            seen.add(description)
            unique.append((name, section, description))
    common = [s for s, _ in Counter(s for _, s, _ in unique).most_common(args.sections)]
    label = {s: i for i, s in enumerate(common)}
    rows = [(name, label[s], features(d, args.buckets)) for name, s, d in unique if s in label]
    if args.max_packages:
        rows = rows[::max(1, len(rows) // args.max_packages)][:args.max_packages]
    train = [(y, x) for name, y, x in rows if zlib.crc32(name.encode()) % 10 != 0]
    test = [(y, x) for name, y, x in rows if zlib.crc32(name.encode()) % 10 == 0]
    return train, test, common


def batch(examples) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat feature ids, offsets, labels) of a list of (label, features)."""
    ids = torch.tensor([f for _, x in examples for f in x], dtype=torch.int64)
    lengths = torch.tensor([len(x) for _, x in examples])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return ids, offsets, torch.tensor([y for y, _ in examples])


class Classifier(torch.nn.Module):
    def __init__(self, bag: torch.nn.Module, dim: int, classes: int):
        super().__init__()
        self.bag = bag
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids, offsets):
        return self.head(self.bag(ids, offsets))


def accuracy(model, test) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test), 1024):
            ids, offsets, y = batch(test[i:i + 1024])
            correct += int((model(ids, offsets).argmax(1) == y).sum())
    model.train()
    return correct / max(1, len(test))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not glob.glob(args.lists):
        print(f"no apt Packages lists at {args.lists}: run `apt-get update`", file=sys.stderr)
        return 2
    train, test, sections = dataset(args)
    print(f"{len(train)} train and {len(test)} test descriptions, {len(sections)} sections, "
          f"{args.buckets} buckets of dim {args.dim}")
    torch.manual_seed(args.seed)
    weight = torch.randn(args.buckets, args.dim) * 0.1
    head_seed = args.seed + 1
    torch.manual_seed(head_seed)
    local = Classifier(torch.nn.EmbeddingBag(args.buckets, args.dim, mode="mean", sparse=True,
                                             _weight=weight.clone()), args.dim, len(sections))
    torch.manual_seed(head_seed)
    remote_bag = RemoteEmbeddingBag(args.buckets, args.dim, name=args.name, mode="mean",
                                    target=args.target, _weight=weight)
    remote = Classifier(remote_bag, args.dim, len(sections))
    local_opts = [torch.optim.SparseAdam(list(local.bag.parameters()), lr=args.lr),
                  torch.optim.AdamW(local.head.parameters(), lr=args.lr, foreach=False)]
    remote_opts = [RemoteSparseAdam([remote_bag], lr=args.lr),
                   RemoteAdamW(remote.head.named_parameters(), lr=args.lr, targets=args.target,
                               prefix=args.name + ".head.")]
    gen = torch.Generator().manual_seed(args.seed)
    steps = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(train), generator=gen).tolist()
        losses = []
        for i in range(0, len(order), args.batch_size):
            ids, offsets, y = batch([train[j] for j in order[i:i + args.batch_size]])
            for model, opts in ((local, local_opts), (remote, remote_opts)):
                for opt in opts:
                    opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(ids, offsets), y)
                loss.backward()
                for opt in opts:
                    opt.step()
            losses.append(float(loss))
            steps += 1
        print(f"epoch {epoch + 1}: train loss {sum(losses) / len(losses):.4f}, test accuracy "
              f"{accuracy(remote, test):.4f} (local {accuracy(local, test):.4f}), "
              f"{time.perf_counter() - start:.1f} s")
    acc, ref = accuracy(remote, test), accuracy(local, test)
    difference = 0.0  # The whole table against the local one, 65,536 rows per lookup.
    for begin in range(0, args.buckets, 1 << 16):
        keys = torch.arange(begin, min(args.buckets, begin + (1 << 16)))
        rows = remote_bag.client.lookup_rows(args.name, keys).rows
        local_rows = local.bag.weight.detach()[keys]
        difference = max(difference, float((rows - local_rows).abs().max()))
    result = dict(test_accuracy=acc, reference_test_accuracy=ref,
                  max_abs_difference=difference, steps=steps, train=len(train), test=len(test),
                  sections=len(sections), buckets=args.buckets, dim=args.dim,
                  seconds=time.perf_counter() - start)
    print("RESULT " + json.dumps(result))
    remote_opts[1].close()
    remote_bag.close()
    ok = min(acc, ref) >= args.min_accuracy and abs(acc - ref) <= args.max_accuracy_gap
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
