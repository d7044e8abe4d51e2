"""Engines behind the typed adapter protocol (``base.Engine``); ``factory.create_engine`` picks one."""
