"""Tools for looking at a conversion: diffs, summaries, drawings, overflow finding, calibration and the command line."""
