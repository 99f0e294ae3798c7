"""The front end: the ``grpokit`` command, which only parses and calls the library — its parser (:mod:`.main`), how
every command reads ``[CONFIG] [--key value ...]`` (:mod:`.options`) and the call each command makes
(:mod:`.commands`)."""
