"""Ray placement of the drafter and the verifier: actors in one placement group, one bundle (device) each."""
