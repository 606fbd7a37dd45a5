from sharegpu.testing.fixtures import fake_api, fake_api_factory  # noqa: F401
