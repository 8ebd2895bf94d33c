"""Device-side machinery: stage runtime, mailboxes, transfers and the local executor."""
