"""The stateful layer of DESIGN §4: mailboxes, TP groups, parities and the decoder."""
