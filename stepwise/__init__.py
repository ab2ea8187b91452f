"""Stepwise: the command line and the wiring that composes both planes."""
