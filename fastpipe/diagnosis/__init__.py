"""The pipeline doctor (``fastpipe.doctor``): where a step's time and memory go, and what to change.

``io`` reads traces (the Chrome/Perfetto JSON that ``trace()`` writes) and step context,
``split`` divides each stage's time into compute, bubble, imbalance, communication, input and
the rest, ``findings`` turns that into ranked advice, and ``report`` holds the ``Diagnosis``.
"""
