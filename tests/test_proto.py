"""The committed generated code matches kvd.proto (regenerate with `make proto`)."""

from kvd_api.generate import stale_files


def test_generated_code_is_up_to_date():
    assert stale_files() == [], "run `make proto` and commit the result"
