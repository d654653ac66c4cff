"""A small transformer language model and a BERT-small encoder with its masked-LM
head, both the usual torch code (``nn.TransformerEncoder``, batch first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TransformerLM(nn.Module):
    """Causal language model: token and positional embeddings, a transformer
    encoder under a causal mask, a final layer norm and the vocabulary head."""

    def __init__(self, vocab=50, d_model=16, nhead=2, num_layers=2, dim_ff=32, max_len=32, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


class BertSmall(nn.Module):
    """BERT's encoder with the masked-LM head (defaults: BERT-small, 4 layers of
    width 512, 8 heads, feed-forward 2048, GELU, post-norm).

    Word, position and token-type embeddings, summed and layer-normed; the
    encoder ignores padding through ``src_key_padding_mask``; the masked-LM
    head (dense, GELU, layer norm) decodes with the word embedding's weight.
    """

    def __init__(self, vocab=30522, hidden=512, num_layers=4, nhead=8, dim_ff=2048, max_len=512,
                 type_vocab=2, dropout=0.1, eps=1e-12):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=eps)
        self.emb_dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, nhead, dim_ff, dropout, activation="gelu",
                                           layer_norm_eps=eps, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=eps)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.word.weight      # BERT ties the decoder to the word embedding
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        """BERT's initialization: weights N(0, 0.02), biases zero (layer norms keep ones and zeros)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, token_type_ids, attention_mask):
        S = input_ids.size(1)
        pos = torch.arange(S, device=input_ids.device)
        h = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        h = self.emb_dropout(self.emb_norm(h))
        h = self.encoder(h, src_key_padding_mask=attention_mask == 0)
        h = self.mlm_norm(F.gelu(self.mlm_dense(h)))
        return self.decoder(h)
