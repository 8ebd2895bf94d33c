"""Applications on top of the library: the command line's subcommands (``demo``, ``info``,
``simulate``, ``doctor``), the progress bar and the small model zoo (``fastpipe.models``).
Nothing in the library imports them."""
