"""The pipeline doctor (``fastpipe.doctor``): where a step's time and memory go, and what to
change, and how sure it is.

``split`` divides each stage's time into compute, bubble, imbalance, communication, input and
the rest, ``findings`` turns that into ranked advice (``layers``: per-layer costs that move with
a layer), ``hardware`` names stages sharing a core, thread or GPU, ``confidence`` weighs each
finding's gain against the traced steps' spread, and ``report`` holds the ``Diagnosis``.
"""
