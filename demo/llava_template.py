"""The LLaVA-1.5 conversation format as a Jinja chat template: the demo models' (models/demo/*/chat_template.jinja
hold this text), and the small random LLaVA fixtures' (tests.fixtures.vlm_zoo.llava).

Each message is its role's prefix, then its content: a list of parts (text, the image's placeholder), or a
string (as text models' templates are given it: pipespec.requests.tokenization), the same as one text part.
The image goes after the message's text, wherever its part stands: the causal language model then reads the
picture's tokens knowing the question, so each cell's token can mark itself as the one asked about, and the
answer only has to find the marked token (with the picture first, the demo target named the asked shape's
colour 23% of the time after 2500 steps; issue 29's note). A system message has its own prefix, "SYSTEM: "; the user's and the assistant's turns render
as the shipped models were trained on them.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% elif message['role'] == 'system' %}SYSTEM: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}\n<image>{% endif %}{% endfor %}"
    "{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
