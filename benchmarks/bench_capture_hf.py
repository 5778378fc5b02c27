"""Hugging Face architectures whole-graph capture cannot take, through ``convert()`` without example inputs.

Builds tiny XLNet, Mamba, DeBERTa-v2 and Wav2Vec2 models from configs (no download), converts each at O1
and O2 (captured from the call: ``amp_report.route == "dynamo"``) and runs two sequence lengths.  Prints,
per model, level and length: the loss and eager autocast's on the same inputs, the share of GEMM FLOPs
that ran bf16 on both (counted at dispatch, tests/probes.py ``GemmFlops``), the seconds so far and the
Dynamo graphs and breaks the report lists.

    PYTHONPATH=. python benchmarks/bench_capture_hf.py [xlnet mamba deberta wav2vec2]
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

import amp_fx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from probes import GemmFlops  # noqa: E402


def _models():
    import transformers as T

    return {
        "xlnet": lambda: T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64)),
        "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                          state_size=4, expand=2, conv_kernel=4)),
        "deberta": lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
            num_labels=3)),
        "wav2vec2": lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
            vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2, do_stable_layer_norm=True, feat_extract_norm="layer")),
    }


def _inputs(name: str, length: int) -> dict:
    if name == "wav2vec2":
        return dict(input_values=torch.randn(2, 80 * length), labels=torch.randint(1, 16, (2, 3)))
    if name == "deberta":
        return dict(input_ids=torch.randint(0, 64, (2, length)), labels=torch.randint(0, 3, (2,)))
    ids = torch.randint(0, 64, (2, length))
    return dict(input_ids=ids, labels=ids)


def main(names: list[str]) -> None:
    warnings.filterwarnings("ignore")
    builds = _models()
    for name in names or list(builds):
        torch.manual_seed(0)
        model = builds[name]().eval()
        for level in ("O1", "O2"):
            torch._dynamo.reset()
            start = time.perf_counter()
            converted = amp_fx.convert(model, level)
            for length in (6, 9):
                torch.manual_seed(length)
                batch = _inputs(name, length)
                with GemmFlops() as flops:
                    loss = converted(**batch).loss
                loss.backward()
                with GemmFlops() as ref_flops, torch.autocast("cpu", dtype=torch.bfloat16):
                    ref = model(**batch).loss
                report = converted.amp_report
                print(f"{name} {level} length {length} route {report.route}: loss {loss.item():.4f} autocast "
                      f"{ref.item():.4f}; bf16 GEMM share {flops.low_share():.3f} autocast {ref_flops.low_share():.3f}; "
                      f"{time.perf_counter() - start:.1f}s, {len(report.graphs)} graphs, {len(report.breaks)} breaks")


if __name__ == "__main__":
    main(sys.argv[1:])
