"""Engines behind the typed adapter protocol (``base.Engine``); ``factory.ENGINES`` names them and
``factory.create_engine`` builds one."""
