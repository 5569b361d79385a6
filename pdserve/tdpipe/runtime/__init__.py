"""The offline batch job and its pipeline: batch file I/O, planning, the controller, stage workers, watchdog."""
