"""bench_dschat.py's fixture: local JSON preference data in DeepSpeed-Chat's `local/jsonfile` layout
(<application>/data/{train,eval}.json with prompt / chosen / rejected), a tiny random OPT with a BPE tokenizer
trained on that data, and a reward-model checkpoint for step 3's critic (DeepSpeed-Chat's RewardModel keys:
rwtransformer.* and v_head.weight, as step 2 saves them)."""

import json
import random
import shutil
import sys
from pathlib import Path


def write_data(root: Path, n_train=320, n_eval=64, seed=0):
    rng = random.Random(seed)
    names = ["red", "blue", "green", "black", "white", "gold", "pink", "gray"]
    def sample():
        a, b = rng.randrange(10), rng.randrange(10)
        c = rng.choice(names)
        if rng.random() < 0.5:
            return {"prompt": f" Human: what is {a} plus {b}? Assistant:", "chosen": f" {a} plus {b} is {a + b}.",
                    "rejected": f" I like the color {c}."}
        return {"prompt": " Human: name a color. Assistant:", "chosen": f" The color {c}.",
                "rejected": f" {a} plus {b} is {a + b + 1}."}
    (root / "data").mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("eval", n_eval)):
        (root / "data" / f"{name}.json").write_text(json.dumps([sample() for _ in range(n)]))

def write_model(out: Path, data_root: Path):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast
    texts = []
    for rec in json.loads((data_root / "data" / "train.json").read_text()):
        texts += [rec["prompt"] + rec["chosen"], rec["prompt"] + rec["rejected"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
                    eos_token_id=2, dropout=0.0, attention_dropout=0.0)
    model = OPTForCausalLM(cfg)
    model.config._name_or_path = str(out)
    model.save_pretrained(out)

def write_critic(model_dir: Path, out: Path):
    """The model directory plus pytorch_model.bin in RewardModel's keys (DeepSpeed-Chat's step 3 loads it with
    torch.load: the format is the application's, not bunsan's)."""
    import torch
    from transformers import AutoModel
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        shutil.copy(f, out / f.name)
    base = AutoModel.from_pretrained(model_dir)
    state = {"rwtransformer." + k: v for k, v in base.state_dict().items()}
    state["v_head.weight"] = torch.randn(1, base.config.word_embed_proj_dim,
                                         generator=torch.Generator().manual_seed(0)) * 0.02
    torch.save(state, out / "pytorch_model.bin")


if __name__ == "__main__":
    chat_root, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    write_data(chat_root)
    write_model(model_dir, chat_root)
