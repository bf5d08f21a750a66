"""`import bunsan.deepspeed.as_deepspeed` = `bunsan.deepspeed.install()`: one import line before a program's own
imports makes its `import deepspeed` mean bunsan.deepspeed (alias.py)."""

from bunsan.deepspeed.alias import install

install()
