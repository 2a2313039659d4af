"""Helpers for the server tests: start the real daemon process and talk to it."""
