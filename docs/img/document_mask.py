"""Draws document_mask.png for docs/documents.md: one row of 16 tokens holding three documents, under the causal
mask and under the document mask, from the trainer's own functions. Run: python docs/img/document_mask.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from meshtrain.model.layers import document_ids, document_mask  # noqa: E402

EOS = 1
tokens = torch.zeros(1, 16, dtype=torch.long)
tokens[0, [4, 11]] = EOS  # documents of 5, 7 and 4 tokens (the last one cut by the window)
docs = document_ids(tokens, EOS)
masks = {"causal": torch.ones(16, 16, dtype=torch.bool).tril(), "document": document_mask(docs)[0, 0]}
fig, axes = plt.subplots(1, 2, figsize=(8, 4.2))
for ax, (name, m) in zip(axes, masks.items(), strict=True):
    ax.imshow(m.numpy(), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_title(f"train.attention_mask={name}")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ticks = range(16)
    ax.set_xticks(ticks, [("eos" if tokens[0, i] == EOS else str(int(docs[0, i]))) for i in ticks], fontsize=7)
    ax.set_yticks(ticks, [str(i) for i in ticks], fontsize=7)
fig.suptitle("one row of three documents (x labels: each key's document; eos ends one)")
fig.tight_layout()
fig.savefig(Path(__file__).with_name("document_mask.png"), dpi=110)
