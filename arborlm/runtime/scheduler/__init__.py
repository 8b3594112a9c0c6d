"""The scheduler: waiting queue and policies, admission budget, decode set, the step loop."""
