"""The figures of issue 40 (item 2): share of GEMM FLOPs that ran low, eager autocast vs the amp_fx backend.

``python benchmarks/run.py coverage-figures`` (or ``python benchmarks/coverage_figures.py``) prints, for an
nn.TransformerEncoder with a causal mask (its mask check's Tensor.item() breaks the graph) and two LSTM
language models without allow_rnn, the low share under eager autocast and through
``torch.compile(model, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner="aot_eager"))``,
measured at dispatch with amp_fx.coverage.  ``--before`` (preset ``coverage-figures-before``) turns amp_fx's
eager mode off (the behaviour before issue 40): what Dynamo runs eagerly then runs fp32.  The shares count
FLOPs, not time, so they do not depend on the CPU.
"""

import sys
import warnings

import torch
import torch.nn as nn

import amp_fx
from amp_fx.inspection.coverage import GemmCounter

if "--before" in sys.argv:
    import amp_fx.dynamo.between_graphs as between_graphs

    between_graphs.attach = lambda backend: None  # the watch calls it through the module: never entered


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64), 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 16)

    def forward(self, x, mask):
        return self.head(self.encoder(self.embed(x), mask))


class LSTMModel(nn.Module):
    """Embedding -> LSTM -> Linear: Dynamo skips the frame."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


class WordLanguageModel(nn.Module):
    """pytorch/examples' word-language model: Dynamo breaks at the LSTM (step_unsupported), the rest runs eagerly."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32, 2, dropout=0.2)
        self.decoder = nn.Linear(32, 50)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden


def _loss(out):
    return (out[0] if isinstance(out, tuple) else out).float().sum()


def main() -> None:
    torch.manual_seed(0)
    cases = {
        "TransformerEncoder": (Encoder(), (torch.randn(6, 2, 16), nn.Transformer.generate_square_subsequent_mask(6))),
        "Embedding-LSTM-Linear": (LSTMModel(), (torch.randint(0, 50, (5, 3)),)),
        "word-language model": (WordLanguageModel(), (torch.randint(0, 50, (7, 3)),
                                                      (torch.zeros(2, 3, 32), torch.zeros(2, 3, 32)))),
    }
    for name, (model, args) in cases.items():
        for mode in ("train", "eval"):
            getattr(model, mode)()
            training = mode == "train"
            grad = torch.enable_grad() if training else torch.no_grad()
            with grad, GemmCounter() as counter:
                with torch.autocast("cpu", torch.bfloat16):
                    out = model(*args)
                if training:
                    _loss(out).backward()  # outside autocast, as training does
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner="aot_eager"))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with grad:
                    compiled(*args)  # compiles
                    got = amp_fx.coverage(compiled, *args, loss_fn=_loss if training else None)
            said = sorted({w.category.__name__ for w in caught if issubclass(w.category, amp_fx.AmpWarning)})
            print(f"{name:22} {mode:5} (fwd{'+bwd' if training else ''}): low share autocast "
                  f"{counter.coverage.low_share:6.1%}, backend {got.low_share:6.1%}; warnings {said}")


if __name__ == "__main__":
    main()
