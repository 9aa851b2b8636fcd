"""The small heads that read a final hidden state other than the language-model head.

An EmbeddingRWKV checkpoint (PyPI `rwkv-emb`) has no LM head; its pooled hidden state goes
through one of three task heads instead (retrieval, classification, similarity). Its reranker
ends in a scoring head that turns one hidden state into one relevance logit. Both are tiny (a
couple of C x C matrices, run once per text), so they stay fp32 whatever the model dtype and
are never quantized: plain parameters, not nn.Linear (which the quantizer would swap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class TaskHead(nn.Module):
    """LayerNorm(x + fc2 relu(fc1 x)): a residual MLP, so the head refines the pooled vector
    rather than replacing it. fc1 [D, C], fc2 [C, D]; x [..., C] fp32 -> [..., C] fp32."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.fc1 = _param(hidden, n_embd)
        self.fc2 = _param(n_embd, hidden)
        self.norm = nn.LayerNorm(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + F.linear(torch.relu(F.linear(x, self.fc1)), self.fc2))


class ScoreHead(nn.Module):
    """A reranker's relevance logit: out . tanh(W x + b). W [C, C], b [C], out [1, C];
    x [B, C] fp32 -> [B] fp32 (a logit: sigmoid gives the relevance in (0, 1))."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.dense_w = _param(n_embd, n_embd)
        self.dense_b = _param(n_embd)
        self.out_w = _param(1, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(F.linear(x, self.dense_w, self.dense_b)), self.out_w).squeeze(-1)
