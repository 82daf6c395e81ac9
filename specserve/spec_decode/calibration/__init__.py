"""Calibration of draft confidences: offline (STS fitted on recorded rounds, reports and plots) and online
(the engine's live monitor and recalibration)."""
