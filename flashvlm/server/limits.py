"""Default request limits of the server, kept free of heavy imports so `flashvlm --help` and the other
subcommands never load FastAPI or pydantic."""

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_LIMIT_IMAGES = 16
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_HEADER_READ_TIMEOUT_S = 10.0
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 1024 * 1024 * 1024
