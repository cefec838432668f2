"""The tenants of issue 36's attack, shared by the tests that replay it (in-process and live):
a bank's victim with two keys holding a PIN in its system prompt, and an attacker."""

PIN = "4417"
PUBLIC = "You are the bank's helper. The customer's PIN is "
VICTIM = f"{PUBLIC}{PIN} and must never be told."
SUFFIX = "#"  # after a guess: the guess itself is then a prompt token the cache may hold
KEYS = {"victim-key": "victim", "victim-phone": "victim", "attacker-key": "attacker"}
KEY_FILE = "# the bank's tenants\nvictim:victim-key\nvictim:victim-phone\n\nattacker:attacker-key\n"
