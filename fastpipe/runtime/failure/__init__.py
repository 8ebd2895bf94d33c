"""Failure handling between ranks: the first failure, posted where every rank reads it, each
rank's sign of life, read to name the rank that holds a pipe up, the bounded waits that watch
both, and the one timeout error every wait raises."""
