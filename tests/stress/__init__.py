"""The reliability suite (README.md here); its helpers import as ``tests.stress.<module>``, its scripts run as ``python -m tests.stress.<script>``."""
