"""Everyday questions for the chat recipe: the target's free prose, which the draft predicts worst.

A wide topic list (nature, science, history, daily life, work, hobbies, stories) crossed with request templates,
drawn without replacement for a seed. Every topic and template is written here; none comes from a benchmark, and
the topics of our own chat eval set (``spec_core/assets/chat_prompts.jsonl``) are left out
(``tests/test_train_draft.py`` checks both).
"""

from __future__ import annotations

import random

#: things one asks about (each fits every template in THING_TEMPLATES)
THINGS = (
    "volcanoes", "earthquakes", "the ocean tides", "coral reefs", "deserts", "glaciers", "tornadoes", "caves",
    "the northern lights", "the moon", "the planet Mars", "comets", "the Milky Way", "magnets", "electricity",
    "sound waves", "the human skeleton", "the stomach", "sleep", "vitamins", "the common cold",
    "bacteria", "the immune system", "DNA", "bees", "ants", "owls", "dolphins", "elephants", "penguins", "sharks",
    "butterflies", "frogs", "horses", "wolves", "octopuses", "bats", "trees in a forest", "mushrooms", "cactus plants",
    "seeds", "the Roman Empire", "ancient Egypt", "the Vikings", "the Middle Ages", "the Renaissance",
    "the invention of the telephone", "the first airplanes", "the printing press", "the steam engine",
    "the Silk Road", "castles", "pyramids", "maps", "the calendar", "money", "banks", "taxes", "elections",
    "newspapers", "museums", "trains", "bridges", "skyscrapers", "ships", "rockets", "satellites", "smartphones",
    "email", "passwords", "video games", "robots", "electric cars", "solar panels", "wind turbines", "recycling",
    "composting", "bread", "cheese", "chocolate", "rice", "honey", "spices", "breakfast", "picnics", "birthdays",
    "holidays", "board games", "chess", "soccer", "basketball", "swimming", "running", "yoga", "painting",
    "photography", "knitting", "gardening", "bird watching", "reading novels", "writing poetry", "museums of art",
    "jazz music", "the piano", "drums", "dancing", "theater", "movies", "cartoons", "fairy tales", "myths",
    "dragons in stories", "pirates", "knights", "astronauts", "firefighters", "nurses", "farmers", "chefs",
    "pilots", "architects", "scientists", "teamwork", "friendship", "kindness", "patience", "curiosity",
    "honesty", "saving money", "budgeting", "time management", "public speaking", "job interviews",
    "moving to a new city", "learning a new language", "making new friends", "keeping a journal", "road trips",
    "hiking", "visiting a new country", "city parks", "libraries of the ancient world", "mountains", "rivers",
    "islands", "lakes", "snow", "clouds", "thunderstorms", "the wind",
)
THING_TEMPLATES = (
    "Write a short paragraph about {t}.", "Explain {t} in simple terms.", "Give me three facts about {t}.",
    "What is interesting about {t}?", "Why are {t} important?", "Describe {t} in a few sentences.",
    "List five things people should know about {t}.", "Write a short poem about {t}.", "Write a haiku about {t}.",
    "Summarize what you know about {t} in two sentences.", "Tell me a fun fact about {t}.",
    "What would a beginner want to know about {t}?", "Write a short story that involves {t}.",
    "What are some common misconceptions about {t}?", "Explain {t} to a seven-year-old.",
    "What questions do children often ask about {t}? Answer one.", "Compare {t} with something similar.",
    "Write a riddle about {t} and give the answer.", "What are the pros and cons of {t}?",
    "Write a short speech about {t}.", "Give me a quiz question about {t}, with the answer.",
    "How have {t} changed over time?", "Describe {t} to someone who has never seen them.",
    "Write a tweet about {t}.",
)
#: requests about doing something (each fits every template in TASK_TEMPLATES)
TASKS = (
    "bake cookies", "make a sandwich", "cook rice", "brew tea", "plan a birthday party", "write a cover letter",
    "prepare for a job interview", "start a small garden", "care for a houseplant", "train a puppy",
    "keep a room tidy", "save money each month", "make a budget", "learn to swim", "ride a bicycle safely",
    "start running", "stretch after sitting all day", "fall asleep faster", "wake up early", "cook an omelette",
    "plan a trip", "pack a suitcase", "write a short story", "give a good presentation", "learn to draw",
    "take better photos", "study for a history test", "memorize a poem", "make a paper airplane",
    "write a birthday card", "apologize to a friend", "make a new friend", "organize a desk",
    "choose a good book", "start a journal", "learn to type faster", "fix a flat bicycle tire",
    "plant a tree", "reduce food waste", "save energy at home", "write a poem", "teach a child to read",
    "stay calm when stressed", "ask for help", "set goals for the year", "host a dinner for friends",
    "make a smoothie", "clean a kitchen", "welcome a new neighbor", "learn basic first aid",
)
TASK_TEMPLATES = (
    "How do I {t}?", "What are some tips to {t}?", "Give me step-by-step instructions to {t}.",
    "What is the easiest way to {t}?", "What mistakes should I avoid when I {t}?",
    "Explain to a beginner how to {t}.", "Write a short checklist to {t}.", "Why is it good to {t}?",
    "I want to {t}. Where do I start?", "Give me three ideas to {t}.",
)


def build_prose_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct everyday requests (things x templates, tasks x templates), deterministic for ``seed``."""
    pool = [tp.format(t=t) for t in THINGS for tp in THING_TEMPLATES]
    pool += [tp.format(t=t) for t in TASKS for tp in TASK_TEMPLATES]
    rng = random.Random(seed)
    rng.shuffle(pool)
    return pool[:n]
