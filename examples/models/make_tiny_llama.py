"""The generation example's files: a tiny Llama (LlamaForCausalLM of seeded random weights) with
a byte-level BPE tokenizer trained on the shipped prompts, and the prompts themselves.

    python3 examples/models/make_tiny_llama.py [MODEL_DIR] [PROMPTS]
        (defaults: examples/models/tiny-llama, examples/data/prompts.jsonl; needs transformers
        and tokenizers: the hf extra)

Everything is drawn from fixed seeds, so running it again writes the same bytes. The prompts
are made of make_sentences.py's sentences, a few words to a few hundred tokens, long-tailed as
real prompts are; the model's completions are noise (random weights), which is all a test of
the generation path needs.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(EXAMPLES))

from make_sentences import sentence  # noqa: E402  (examples/ is no package)

VOCAB = 512
MAX_POSITIONS = 1024
BOS, EOS = "<s>", "</s>"  # ids 0 and 1; padding uses EOS, as many Llama checkpoints do
N_PROMPTS = 200
MAX_WORDS = 200  # the longest prompts: a few hundred tokens, within the 512 seq bucket


def prompts(n: int = N_PROMPTS, seed: int = 0) -> list[str]:
    """n prompts of 1 to 12 sentences, the count log-normal: most short, a few long."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        count = min(12, max(1, int(math.exp(rng.gauss(0.6, 0.9)))))
        words = " ".join(sentence(rng) for _ in range(count)).split()
        if rng.random() < 0.1:  # a few words only, as a chat's first turn often is
            words = words[:rng.randint(2, 5)]
        text = " ".join(words[:MAX_WORDS])
        out.append(text)
    return out


def write_prompts(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"p{i:04d}", "prompt": text}) + "\n")


def train_tokenizer(texts: list[str]):
    """A byte-level BPE of VOCAB ids (every byte kept, so any text encodes), BOS prepended as
    Llama's tokenizer does; wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, padding_side="left",
                                   model_max_length=MAX_POSITIONS)


# a small chat template in the Llama 3 manner (BOS, a header per turn, each turn ended by EOS),
# so that chat records and OpenAI Batch chat requests run on this model too
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _portable_tokenizer_files(folder: Path) -> None:
    """transformers 5 names its own backend class and writes no special_tokens_map.json;
    PreTrainedTokenizerFast and the map load in older transformers too."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def save_model(folder: Path, seed: int = 0) -> None:
    """2 layers x 64 wide, 4 query heads sharing 2 KV heads (grouped-query, as Llama 3)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)  # config, generation_config, safetensors


def write_all(folder: Path, out: Path) -> None:
    texts = prompts()
    write_prompts(out, texts)
    save_model(folder)
    train_tokenizer(texts).save_pretrained(folder)
    _portable_tokenizer_files(folder)


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else EXAMPLES / "models" / "tiny-llama"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else EXAMPLES / "data" / "prompts.jsonl"
    write_all(folder, out)
    print(f"wrote {folder} and {N_PROMPTS} prompts to {out}")


if __name__ == "__main__":
    main()
