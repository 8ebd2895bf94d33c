"""Failure handling between ranks: the first failure, posted where every rank reads it, and each
rank's sign of life, read to name the rank that holds a pipe up."""
