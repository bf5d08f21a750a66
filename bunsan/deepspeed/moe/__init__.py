"""`deepspeed.moe`: bunsan has no mixture-of-experts layers. Importing the helpers scripts import anyway works
(they leave a model without experts as it is); building an MoE layer is an error naming what is missing."""
