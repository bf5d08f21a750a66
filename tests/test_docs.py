"""The documentation is a test: every code block of README.md and docs/*.md runs as written, in order, in one
working directory per page, at tiny sizes. Python blocks run as scripts; shell blocks run in bash with the
suite's `.venv/bin` first on PATH; JSON blocks load as configs (a fragment `"key": {...}` inside braces);
`text` blocks are synopses and file layouts, never run. A block in any other language fails: say what it is.

Tiny sizes, and only these changes to what a block says:
- `bash scripts/test` is skipped (it is this very run); `bash scripts/train ARGS` runs `bunsan train ARGS`
  (scripts/train is the set-up this suite already ran, then that command);
- `bunsan train` gets `--steps 2 --seq-len 64 --micro-batch 2` appended (the last of a repeated flag wins),
  and `--preset tiny` unless it starts from `--init-from`; `bunsan generate` gets `--max-new-tokens 8`;
- the working directory holds what the blocks name as the user's: `Llama-3.2-1B-Instruct/` (a tiny random
  Llama with a ChatML tokenizer and chat template), `chat.jsonl` and `pairs.jsonl`, and `.venv` (this suite's).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUN = ("python", "bash", "json")
NOT_CODE = ("text",)
TIMEOUT_S = 600
FENCE = re.compile(r"^```(\S*)\s*$")


def code_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, language, text) of each fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body = m.group(1), n, []
        elif lang is not None and line.strip() == "```":
            out.append((start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page}: the block opened at line {start} is never closed"
    return out


BLOCKS = [(page, line, lang, text) for page in PAGES for line, lang, text in code_blocks(page)]


def test_every_block_says_what_it_is():
    for page, line, lang, _ in BLOCKS:
        assert lang in RUN + NOT_CODE, (f"{page.relative_to(ROOT)}:{line}: a ```{lang} block; mark it python, bash "
                                        "or json (it runs here) or text (a synopsis, never run)")
    assert any(lang == "python" for _, _, lang, _ in BLOCKS) and any(lang == "bash" for _, _, lang, _ in BLOCKS)


# -- the shell's tiny sizes ------------------------------------------------------------------------------------
TRAIN_TINY = ["--steps", "2", "--seq-len", "64", "--micro-batch", "2"]


def _logical_lines(script: str) -> list[str]:
    return script.replace("\\\n", " ").splitlines()


def tiny(script: str) -> str:
    """The block's commands at tiny sizes (the module docstring's rules); heredocs pass untouched."""
    out, heredoc = [], None
    for line in _logical_lines(script):
        if heredoc is not None:
            out.append(line)
            if line.strip() == heredoc:
                heredoc = None
            continue
        if m := re.search(r"<<-?\s*'?(\w+)'?", line):
            heredoc = m.group(1)
        code, _, comment = line.partition(" #")
        words = code.split()
        if words[:2] == ["bash", "scripts/test"]:
            out.append("true  # (scripts/test: this run)")
            continue
        if words[:2] == ["bash", "scripts/train"]:
            code = code.replace("bash scripts/train", "bunsan train", 1)
            words = code.split()
        command = [w.rsplit("/", 1)[-1] for w in words[:2]]
        if command == ["bunsan", "train"]:
            code = code.rstrip() + " " + " ".join(TRAIN_TINY + ([] if "--init-from" in words else ["--preset", "tiny"]))
        elif command == ["bunsan", "generate"]:
            code = code.rstrip() + " --max-new-tokens 8"
        out.append(code.rstrip() + (f"  #{comment}" if comment else ""))
    return "\n".join(out) + "\n"


def test_tiny_changes_only_sizes():
    got = tiny("bash scripts/train --steps 50   # more\nbunsan train --init-from ./m --lora \\\n  --steps 500\n"
               "bash scripts/test\n.venv/bin/bunsan generate --checkpoint r\n")
    assert got.splitlines() == [
        "bunsan train --steps 50 --steps 2 --seq-len 64 --micro-batch 2 --preset tiny  # more",
        "bunsan train --init-from ./m --lora    --steps 500 --steps 2 --seq-len 64 --micro-batch 2",
        "true  # (scripts/test: this run)", ".venv/bin/bunsan generate --checkpoint r --max-new-tokens 8"]


# -- the user's files the blocks name ------------------------------------------------------------------------
def _instruct_model(d: Path) -> None:
    import torch
    from bunsan.models import Llama, LlamaConfig
    from bunsan.models.hf import save_llama
    from chat_tokenizer import save_chat_tokenizer
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    save_llama(Llama(cfg).state_dict(), cfg, d)
    save_chat_tokenizer(d)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working directory per page (its blocks run in order there), with the user's files (the model made
    once, each page its own copy: a block may write into it)."""
    import shutil
    model = tmp_path_factory.mktemp("user-files") / "Llama-3.2-1B-Instruct"
    _instruct_model(model)
    dirs = {}
    for page in PAGES:
        d = tmp_path_factory.mktemp(page.stem)
        (d / ".venv").symlink_to(Path(sys.prefix))       # this suite's environment
        shutil.copytree(model, d / model.name)
        chats = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                               {"role": "assistant", "content": f"{i + 1}."}]} for i in range(16)]
        (d / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
        pairs = [{"prompt": f"What is {i} + 1? ", "chosen": f"{i + 1}.", "rejected": f"{i + 2}."} for i in range(16)]
        (d / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        dirs[page] = d
    return dirs


def _env(cwd: Path) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}


def _run(argv, cwd: Path, what: str) -> None:
    r = subprocess.run(argv, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"


def _config(text: str, what: str) -> None:
    import bunsan
    body = text.strip()
    data = json.loads(body if body.startswith("{") else "{" + body + "}")
    bunsan.Config.load(data)


CONFIGS = [b for b in BLOCKS if b[2] == "json"]
SCRIPTS = [b for b in BLOCKS if b[2] in RUN and b[2] != "json"]


@pytest.mark.parametrize("page,line,lang,text", CONFIGS, ids=[f"{b[0].name}:{b[1]}" for b in CONFIGS])
def test_json_block_loads(page, line, lang, text):
    _config(text, f"{page.relative_to(ROOT)}:{line} ({lang})")


@pytest.mark.e2e         # each block as the user runs it: a script, or a shell with the `bunsan` command
@pytest.mark.parametrize("page,line,lang,text", SCRIPTS, ids=[f"{b[0].name}:{b[1]}" for b in SCRIPTS])
def test_block_runs(workdirs, page, line, lang, text):
    cwd = workdirs[page]
    what = f"{page.relative_to(ROOT)}:{line} ({lang})"
    if lang == "python":
        script = cwd / f"block_{line}.py"
        script.write_text(text)
        _run([sys.executable, script.name], cwd, what)
    else:
        _run(["bash", "-euo", "pipefail", "-c", tiny(text)], cwd, what + ":\n" + tiny(text))


def test_commands_in_text_blocks_name_real_flags():
    """A synopsis is not run, but each `bunsan CMD --flag` it names must be a flag the command has."""
    from bunsan.cli.main import build_parser
    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for page, line, lang, text in BLOCKS:
        if lang != "text":
            continue
        for logical in _logical_lines(text):
            words = logical.split("#")[0].replace("[", " ").replace("]", " ").replace("|", " ").split()
            if words[:1] != ["bunsan"] or len(words) < 2 or words[1] not in subs or words[1] == "run":
                continue
            known = {o for a in subs[words[1]]._actions for o in a.option_strings}
            flags = {w.split("=")[0] for w in words if w.startswith("--")}
            assert not flags - known, f"{page.name}:{line}: bunsan {words[1]} has no {sorted(flags - known)}"


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "README.md"], ids=lambda p: p.name)
def test_links_stay_inside_the_repository(page):
    """A user's clone has nothing outside it: every relative link resolves to a file of the repository."""
    for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target = (page.parent / link).resolve()
        assert target.is_relative_to(ROOT.resolve()), f"{page.name} links to {link}, outside the repository"
        assert target.exists(), f"{page.name} links to {link}, which does not exist"


def test_the_readme_is_a_quickstart():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md is the five-minute quickstart; the rest goes to docs/"
    assert "bash scripts/train" in text and "bash scripts/test" in text
