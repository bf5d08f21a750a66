"""The names of DeepSpeed's `deepspeed.launcher.runner` that accelerate imports when it launches a DeepSpeed
config. DeepSpeed's multi-node runner itself (pdsh, hostfiles) is not bunsan's: accelerate's "standard"
multi-node launcher (torchrun on each node) is."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"   # the file DeepSpeed's runner exports to every node (its name)


def main(args=None):
    raise NotImplementedError("DeepSpeed's own launcher (the `deepspeed` command, pdsh across a hostfile) is not "
                              "bunsan's: start each node with torchrun (or `bunsan train --nnodes`), or run "
                              "`python -m bunsan.deepspeed.accelerate_launch` with deepspeed_multinode_launcher: "
                              "standard in accelerate's config")
