"""Shared pieces of the perplexity tests: a real (tiny, trained here) tokenizer and a tiny causal LM."""

import pytest
import torch

TRAIN_TEXT = (
    "Perplexity is the exponential of the average negative log-likelihood of a text.\n"
    "The quick brown fox jumps over the lazy dog; the lazy dog sleeps.\n"
    "Windows are disjoint, and every token of a document is scored exactly once!\n"
    "Numbers such as 3.14, 42 and 2025 appear too (with brackets) and \"quotes\".\n"
)


def make_tokenizer(vocab_size: int = 120):
    """A byte-pair tokenizer trained on TRAIN_TEXT, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TRAIN_TEXT] * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<bos>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


class TinyCausalLM(torch.nn.Module):
    """Logits at position t depend on tokens 0..t and on t itself: a causal LogitsFn in a few lines."""

    def __init__(self, vocab: int, dim: int = 16, max_len: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(max_len, dim, generator=g) * 0.5)
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        x = self.emb[tokens]  # (B, T, D)
        h = x.cumsum(1) / torch.arange(1, T + 1)[:, None] + self.pos[:T]  # running mean: causal
        return torch.tanh(h) @ self.out  # (B, T, V)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_lm(tokenizer):
    return TinyCausalLM(len(tokenizer)).eval()
