"""Launch: the process's place in the job from torchrun or SLURM variables (env.py), the rendezvous and
its start-up errors (rendezvous.py), SLURM's variables translated (slurm.py), one job per run directory."""

from trillion.trainer.launch.env import LaunchEnv, check_same_config, init_launch_env, pick_device, restarted
from trillion.trainer.launch.run_lock import RunDirectoryLock

__all__ = ["LaunchEnv", "RunDirectoryLock", "check_same_config", "init_launch_env", "pick_device", "restarted"]
