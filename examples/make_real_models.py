"""The small real-model examples' files: a GPT-2 and a ResNet image classifier of random
seeded weights saved as local Hugging Face folders (examples/models/gpt2-tiny and
examples/models/resnet-tiny, what pipelines/gpt2-next-token.yaml and pipelines/resnet-top5.yaml
load), the token file, and the images of pipelines/resnet-top5.yaml and resnet18-top5.yaml.

    python3 examples/make_real_models.py [MODEL_DIR]   (needs transformers: the hf extra)

With MODEL_DIR only the GPT-2 is written, there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VOCAB = 1000


def save_gpt2(folder: Path, seed: int = 0) -> Path:
    """A 2-layer GPT-2 (GPT2Config, vocab 1000, 32 wide), random weights from `seed`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # BOS and EOS inside the vocabulary (GPT2Config's 50256 is past it, which transformers
    # warns of on every load)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def save_resnet(folder: Path, seed: int = 0) -> Path:
    """resnet18's layout (4 stages of 2 basic blocks) at 1/8 of its width (8 to 64 channels),
    100 classes, random weights from `seed`: about 180,000 parameters, under 1 MB."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2],
                          layer_type="basic", num_labels=100)
    ResNetForImageClassification(config).save_pretrained(folder)  # model.safetensors
    return folder


def write_tokens(path: Path, n: int = 120, seed: int = 0) -> None:
    """Records {id, input_ids, attention_mask} of 3 to 60 tokens."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(n):
            length = int(rng.integers(3, 61))
            ids = rng.integers(0, VOCAB, length).tolist()
            f.write(json.dumps({"id": f"t{i:04d}", "input_ids": ids,
                                "attention_mask": [1] * length}) + "\n")


def write_images(path: Path, n: int = 30, seed: int = 0) -> None:
    """[n, 3, 32, 32] float32 images, normalised as a vision model expects (mean 0, std 1)."""
    np.save(path, np.random.default_rng(seed).standard_normal((n, 3, 32, 32), np.float32))


if __name__ == "__main__":
    model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "models" / "gpt2-tiny"
    save_gpt2(model_dir)
    print(f"wrote {model_dir}")
    if len(sys.argv) == 1:
        save_resnet(HERE / "models" / "resnet-tiny")
        write_tokens(HERE / "data" / "tokens.jsonl")
        write_images(HERE / "data" / "images.npy")
