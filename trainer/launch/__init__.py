"""Launch: the process's place in the job from torchrun or SLURM variables (env.py), the rendezvous and
its start-up errors (rendezvous.py), SLURM's variables translated (slurm.py)."""

from trillion.trainer.launch.env import LaunchEnv, check_same_config, init_launch_env, pick_device

__all__ = ["LaunchEnv", "check_same_config", "init_launch_env", "pick_device"]
