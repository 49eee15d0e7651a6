"""rankboard web: gevent Flask SSE server and the dashboard page."""
