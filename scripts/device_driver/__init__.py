"""The driver of ``scripts/device_check.sh`` in parts (standard library only): the plan of steps and
budget slices (:mod:`.plan`), running a step (:mod:`.runner`), each step's command and reader
(:mod:`.steps`), and the summary files (:mod:`.report`). ``scripts/device_check.py`` runs them."""
