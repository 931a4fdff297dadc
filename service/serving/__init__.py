"""How a request is served, whatever carries it: the stream plan, admission and stream
limits, authentication, files, model views, Arrow framing and metrics."""
