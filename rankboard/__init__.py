"""rankboard's command line, above ``broker/`` and ``web/``: the entry point (``cli``), the
typed configs built from its flags (``config``), the commands that run both layers (``up``,
``demo``) and how child processes are started (``process``). Nothing below imports this
package."""
