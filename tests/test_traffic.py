"""The weight bytes a decode step reads (strata/weights/traffic.py): a tiny qwen3_moe's
stage against the bytes of transformers' own parameters (all of them but the embedding
table, the experts at top-k / E); a tensor shared by two modules counted once; the MTP
layer and the embedding left out; and solo_speed's table carrying the roofline columns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch import nn

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.weights.traffic import decode_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_a_moe_stage_reads_its_top_k_experts_and_no_embedding(tiny_models):
    folder, reference = tiny_models["qwen3_moe"]
    engine = Engine(EngineConfig(model=str(folder), dtype="fp32", spec=0, max_context=64))
    c = reference.config
    params = dict(reference.named_parameters())  # each tensor once (tied or not)
    size = {n: p.numel() * 4 for n, p in params.items()}
    experts = sum(v for n, v in size.items() if ".mlp.experts." in n)
    embed = size["model.embed_tokens.weight"]
    tied = reference.lm_head.weight is reference.model.embed_tokens.weight
    expected = (sum(size.values()) - embed + (embed if tied else 0)
                - experts * (1 - c.num_experts_per_tok / c.num_experts))
    assert experts > 0 and abs(decode_bytes(engine.runner.stages[0].module) - expected) <= 1


def test_shared_tensors_count_once_and_mtp_is_left_out():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.norm = nn.LayerNorm(4, bias=False)
            self.mtp = nn.Linear(4, 4)

    assert decode_bytes(Toy()) == (10 * 4 + 4) * 4  # the head once, the norm; no mtp


def test_solo_speed_prints_the_roofline(tiny_models):
    folder, _ = tiny_models["qwen3_moe"]
    result = subprocess.run(
        [sys.executable, "benchmarks/solo_speed.py", "--model", str(folder), "--prompt-tokens",
         "8", "--decode-tokens", "4", "--repeats", "1", "--bandwidth", "100"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "MiB of weights a decode step at 100 GB/s (given)" in result.stdout
    row = [line for line in result.stdout.splitlines() if line.startswith("| 8 | 4 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    decode, roofline, share = float(cells[3]), float(cells[4]), cells[5]
    assert roofline > 0 and share == f"{decode / roofline:.0%}"
