"""Choices the front doors make from measurements of the pipe itself: the schedule
(``schedule='auto'``), the micro-batch count (``chunks='auto'``) and the CPU worker threads."""
