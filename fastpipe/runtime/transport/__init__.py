"""How messages move between stages: in-process mailboxes, device copies with stream ordering,
the tagged and grouped point-to-point transports, their wire format, and the process groups."""
