"""Tensor lists (name, shape) of GPT models with HF GPT2LMHeadModel's names, for plan tests.

    python3 gpt_shapes.py OUT.json   writes GPT-2 small's list as [{"name", "shape"}, ...]
    (tests/data/gpt2_small_tensors.json, which the C++ plan tests read).
"""

from __future__ import annotations

import json
import sys
from typing import List, Tuple

Shape = Tuple[int, ...]


def gpt_tensors(d_model: int, layers: int, vocab: int = 50257,
                context: int = 1024) -> List[Tuple[str, Shape]]:
    """(name, shape) of every parameter of a GPT-2-style model (tied lm_head: not listed), in
    the order of named_parameters()."""
    d = d_model
    out: List[Tuple[str, Shape]] = [("transformer.wte.weight", (vocab, d)),
                                    ("transformer.wpe.weight", (context, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        out += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return out


def gpt2_small() -> List[Tuple[str, Shape]]:
    """GPT-2 small: 124,439,808 parameters."""
    return gpt_tensors(768, 12, context=1024)


def gpt_1_3b() -> List[Tuple[str, Shape]]:
    """The GPT-3 paper's 1.3B configuration: d_model 2048, 24 layers, context 2048."""
    return gpt_tensors(2048, 24, context=2048)


def write_json(tensors, path: str) -> None:
    """Writes [{"name", "shape"}, ...] as JSON, one tensor a line."""
    lines = [json.dumps({"name": n, "shape": list(s)}, ensure_ascii=False) for n, s in tensors]
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n " + ",\n ".join(lines) + "\n]\n")


if __name__ == "__main__":
    write_json(gpt2_small(), sys.argv[1])
