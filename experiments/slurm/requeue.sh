# Sourced by the job scripts: chain time-limited jobs into one run.
# SLURM sends SIGUSR1 to the batch shell some minutes before the time limit (--signal=B:USR1@SECONDS).
# The shell sends it on to the job's steps (`scancel --signal=USR1`): the ranks, or `trillion torchrun`,
# which passes it to its ranks, finish the step they are in, save a checkpoint and exit 0
# (`trillion torchrun` printing "preempted, saved: ..."). Once the step has ended, the job puts itself
# back in the queue, and the next start of the same command resumes from that checkpoint. Set
# training.exit_after_minutes a little below the time limit too, so the trainer saves and exits on its
# own if the warning comes late.
PREEMPTED=0
send_usr1_on() {
  echo "$(date) SIGUSR1: time limit near; the ranks save after their step, then job ${SLURM_JOB_ID} requeues"
  PREEMPTED=1
  scancel --signal=USR1 "${SLURM_JOB_ID}"  # the job's steps, not this batch shell
}
trap send_usr1_on USR1

# run_steps PID...: wait for the job steps started in the background (the USR1 trap runs meanwhile), then
# requeue if the warning came; exits with the first failed step's status (0 when all ended cleanly).
run_steps() {
  local status=0 pid code
  for pid in "$@"; do
    while true; do
      code=0
      wait "${pid}" || code=$?
      kill -0 "${pid}" 2>/dev/null || break  # a trap interrupted `wait`: the step is still running
    done
    (( status == 0 )) && status=${code}
  done
  if (( PREEMPTED )); then
    scontrol requeue "${SLURM_JOB_ID}"
  fi
  return "${status}"
}
