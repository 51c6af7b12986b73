# Sourced by the job scripts: chain time-limited jobs into one run.
# SLURM sends SIGUSR1 to the batch shell some minutes before the time limit (--signal=B:USR1@SECONDS);
# the job puts itself back in the queue, and the next start of the same command resumes from the
# newest complete checkpoint in job.output_dir. Set training.exit_after_minutes a little below the
# time limit too, so the trainer itself saves and exits cleanly before the signal matters.
requeue_on_usr1() {
  echo "$(date) SIGUSR1: time limit near, requeueing job ${SLURM_JOB_ID}"
  scontrol requeue "${SLURM_JOB_ID}"
}
trap requeue_on_usr1 USR1
