"""Helpers the tests share: models and tokenizers, engines, servers, admission fakes, kernel problems."""
