"""Device-side machinery: one step of one stage, the executors that run a stage's program, and
beneath them the transports, failure handling, gradient synchronisation and observation."""
